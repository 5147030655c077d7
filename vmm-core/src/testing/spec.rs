//! What one generated test is: the attribute's options, and what its body may return.
//! Shared by the expansion's entry points (`__private`) and the runtime (`runner`).

use std::fmt::Debug;

use crate::process::StartMethod;

/// The attribute's options for one generated test (one start method).
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// `module_path!()` inside the generated module (`crate::path::to::function_name`).
    pub module_path: &'static str,
    /// The annotated function's name.
    pub function: &'static str,
    /// This generated test's start method.
    pub method: StartMethod,
    /// `timeout = SECS`, if given.
    pub timeout_secs: Option<u64>,
    /// `thread_unsafe = "reason"`, if given.
    pub thread_unsafe: Option<&'static str>,
}

/// What a test body may return: `()` or `Result<(), E: Debug>`.
pub trait TestReturn {
    /// `Err(message)` when the body failed.
    fn into_result(self) -> Result<(), String>;
}

impl TestReturn for () {
    fn into_result(self) -> Result<(), String> {
        Ok(())
    }
}

impl<E: Debug> TestReturn for Result<(), E> {
    fn into_result(self) -> Result<(), String> {
        self.map_err(|e| format!("{e:?}"))
    }
}
