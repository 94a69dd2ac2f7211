//! The one engine interface (filled in below).
