//! Host shared memory (memfd).
