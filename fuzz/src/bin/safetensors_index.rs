//! AFL++ entry for the `safetensors_index` target (see `fuzz/targets.rs`).
#[allow(dead_code)] // each binary uses one target of the shared file
#[path = "../../targets.rs"]
mod targets;

fn main() {
    afl::fuzz!(|data: &[u8]| targets::safetensors_index(data));
}
