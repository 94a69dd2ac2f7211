//! One process-wide gate between stream captures and the driver calls that must not run while
//! any stream of the context is being captured: registering or unregistering host memory,
//! allocating or freeing pinned memory, destroying a graph. Those calls may synchronize the
//! whole context, which breaks a capture in progress on another thread (seen on the H100: GPU
//! tests of several engines in parallel threads failed now and then once every engine
//! registered its model file, each alone passed). Captures share the gate (several may run at
//! once: each thread captures its own stream); the gated calls take it alone.

use std::sync::{Condvar, Mutex};

/// Captures in progress, and whether a gated call runs.
struct Gate {
    state: Mutex<(usize, bool)>,
    changed: Condvar,
}

static GATE: Gate = Gate { state: Mutex::new((0, false)), changed: Condvar::new() };

fn lock() -> std::sync::MutexGuard<'static, (usize, bool)> {
    GATE.state.lock().unwrap_or_else(|e| e.into_inner())
}

/// A capture begins: waits while a gated call runs.
pub(crate) fn enter_capture() {
    let mut s = lock();
    while s.1 {
        s = GATE.changed.wait(s).unwrap_or_else(|e| e.into_inner());
    }
    s.0 += 1;
}

/// A capture ended (every [`enter_capture`] is paired with one).
pub(crate) fn leave_capture() {
    let mut s = lock();
    assert!(s.0 > 0, "leave_capture without enter_capture");
    s.0 -= 1;
    GATE.changed.notify_all();
}

/// Run `f` while no capture is in progress anywhere in the process (and no other gated call).
pub(crate) fn exclusive<R>(f: impl FnOnce() -> R) -> R {
    let mut s = lock();
    while s.0 > 0 || s.1 {
        s = GATE.changed.wait(s).unwrap_or_else(|e| e.into_inner());
    }
    s.1 = true;
    drop(s);
    let r = f();
    lock().1 = false;
    GATE.changed.notify_all();
    r
}
