//! Scalar helpers shared by the fast paths (pipeline, router, cold-lane expert math). The
//! reference oracle has its own copies on purpose: a bug here must not hide in both.

/// `a · b` accumulated in f32, in index order.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        acc += x * y;
    }
    acc
}

/// Softmax in place (max-subtracted, f32).
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forward::argmax;

    #[test]
    fn argmax_takes_first_of_ties_and_softmax_sums_to_one() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        let mut x = [1.0f32, 2.0, 3.0];
        softmax_in_place(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[2] > x[1] && x[1] > x[0]);
        assert_eq!(dot(&[1.0, 2.0], &[3.0, 4.0]), 11.0);
    }

    /// The scan the fast argmax must agree with.
    fn argmax_scan(values: &[f32]) -> u32 {
        let mut best = 0;
        for (i, v) in values.iter().enumerate() {
            if *v > values[best] {
                best = i;
            }
        }
        best as u32
    }

    proptest::proptest! {
        #[test]
        fn argmax_matches_the_scan(
            picks in proptest::collection::vec(0u8..12, 0..300),
        ) {
            // Few distinct values (ties everywhere), NaNs, infinities and both zeros.
            let table = [f32::NAN, -0.0, 0.0, 1.0, -1.0, 2.5, 2.5, f32::INFINITY, f32::NEG_INFINITY, 7.0, -7.0, 3.0];
            let values: Vec<f32> = picks.iter().map(|&p| table[p as usize]).collect();
            proptest::prop_assert_eq!(argmax(&values), argmax_scan(&values));
        }
    }

    #[test]
    fn argmax_edge_cases() {
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NAN, 5.0, 6.0]), 0, "a NaN first is kept, as the scan keeps it");
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        let mut long = vec![0.5f32; 1000];
        long[977] = 9.0;
        long[999] = 9.0;
        assert_eq!(argmax(&long), 977);
    }
}
