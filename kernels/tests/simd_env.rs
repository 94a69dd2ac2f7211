//! SIMD level names, detection and forcing.

use moe_lanes_kernels::{available, KernelError, SimdLevel};

#[test]
fn simd_level_names_parse_and_a_forced_level_is_checked() {
    for level in SimdLevel::ALL {
        assert_eq!(SimdLevel::parse(level.name()), Ok(level));
        assert_eq!(level.name().to_uppercase().parse::<SimdLevel>(), Ok(level));
    }
    assert!(matches!(SimdLevel::parse("sse9"), Err(KernelError::UnknownSimdLevel { .. })));
    assert_eq!(available()[0], SimdLevel::Scalar);
    assert_eq!(SimdLevel::detect(), *available().last().unwrap());

    assert_eq!(SimdLevel::resolve(None), Ok(SimdLevel::detect()));
    for level in SimdLevel::ALL {
        let forced = SimdLevel::resolve(Some(level));
        if level.is_supported() {
            assert_eq!(forced, Ok(level));
        } else {
            assert!(matches!(forced, Err(KernelError::UnsupportedSimdLevel { .. })), "{level}: {forced:?}");
        }
    }
    assert!(matches!(SimdLevel::from_forced_name("avx1024"), Err(KernelError::UnknownSimdLevel { .. })));
}
