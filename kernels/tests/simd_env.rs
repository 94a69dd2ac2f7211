//! `MOE_LANES_SIMD` parsing and forcing. One test function: it mutates the process environment.

use moe_lanes_kernels::{available, KernelError, SimdLevel, SIMD_ENV_VAR};

#[test]
fn simd_level_names_parse_and_env_forces_a_level() {
    for level in SimdLevel::ALL {
        assert_eq!(SimdLevel::parse(level.name()), Ok(level));
        assert_eq!(level.name().to_uppercase().parse::<SimdLevel>(), Ok(level));
    }
    assert!(matches!(SimdLevel::parse("sse9"), Err(KernelError::UnknownSimdLevel { .. })));
    assert_eq!(available()[0], SimdLevel::Scalar);
    assert_eq!(SimdLevel::detect(), *available().last().unwrap());

    std::env::remove_var(SIMD_ENV_VAR);
    assert_eq!(SimdLevel::from_env_or_detect(), Ok(SimdLevel::detect()));
    for level in SimdLevel::ALL {
        std::env::set_var(SIMD_ENV_VAR, level.name());
        let forced = SimdLevel::from_env_or_detect();
        if level.is_supported() {
            assert_eq!(forced, Ok(level));
        } else {
            assert!(matches!(forced, Err(KernelError::UnsupportedSimdLevel { .. })), "{level}: {forced:?}");
        }
    }
    std::env::set_var(SIMD_ENV_VAR, "avx1024");
    assert!(matches!(SimdLevel::from_env_or_detect(), Err(KernelError::UnknownSimdLevel { .. })));
    std::env::remove_var(SIMD_ENV_VAR);
}
