//! One process-wide gate between stream captures and the driver calls that must not run while
//! any stream of the context is being captured: registering or unregistering host memory,
//! allocating or freeing pinned memory, destroying a graph, mapping a paged buffer's pages,
//! loading or unloading the kernels' module and creating or destroying the cuBLAS handle (an
//! engine starting or going while another captures its decode graph). Those calls may
//! synchronize the whole context, which breaks a capture in progress on another thread (seen on
//! the H100: GPU tests of several engines in parallel threads failed now and then once every
//! engine registered its model file, each alone passed). Captures share the gate (several may
//! run at once: each thread captures its own stream); the gated calls take it alone. A gated
//! call on a thread that is capturing itself does not wait (it would wait for itself): it goes
//! to the driver, which refuses what a capture forbids.

use std::cell::Cell;
use std::sync::{Condvar, Mutex};

/// Captures in progress, and whether a gated call runs.
struct Gate {
    state: Mutex<(usize, bool)>,
    changed: Condvar,
}

static GATE: Gate = Gate { state: Mutex::new((0, false)), changed: Condvar::new() };

thread_local! {
    /// Captures this thread has in progress.
    static CAPTURING_HERE: Cell<usize> = const { Cell::new(0) };
}

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
    CAPTURING_HERE.with(|c| c.set(c.get() + 1));
}

/// A capture ended (every [`enter_capture`] is paired with one).
pub(crate) fn leave_capture() {
    let mut s = lock();
    assert!(s.0 > 0, "leave_capture without enter_capture");
    s.0 -= 1;
    CAPTURING_HERE.with(|c| c.set(c.get().saturating_sub(1)));
    GATE.changed.notify_all();
}

/// Run `f` while no capture is in progress anywhere in the process (and no other gated call).
pub(crate) fn exclusive<R>(f: impl FnOnce() -> R) -> R {
    if CAPTURING_HERE.with(Cell::get) > 0 {
        return f();
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A gated call waits for captures on other threads, never for one on its own thread.
    #[test]
    fn gated_calls_wait_for_other_threads_captures_only() {
        enter_capture();
        assert_eq!(exclusive(|| 7), 7, "its own capture does not block it");
        let (tx, rx) = std::sync::mpsc::channel();
        let other = std::thread::spawn(move || exclusive(|| tx.send(()).unwrap()));
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(rx.try_recv().is_err(), "another thread waits while this one captures");
        leave_capture();
        other.join().unwrap();
        assert!(rx.try_recv().is_ok(), "and runs once the capture ended");
    }
}
