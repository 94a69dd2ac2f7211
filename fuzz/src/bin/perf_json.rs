//! AFL++ entry for the `perf_json` target (see `fuzz/targets.rs`).
#[allow(dead_code)] // each binary uses one target of the shared file
#[path = "../../targets.rs"]
mod targets;

fn main() {
    afl::fuzz!(|data: &[u8]| targets::perf_json(data));
}
