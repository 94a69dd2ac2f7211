//! AFL++ entry for the `completion_request` target (see `fuzz/targets.rs`).
#[allow(dead_code)] // each binary uses one target of the shared file
#[path = "../../targets.rs"]
mod targets;

fn main() {
    afl::fuzz!(|data: &[u8]| targets::completion_request(data));
}
