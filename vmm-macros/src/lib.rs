//! Procedural macros of vmm-ipc. Use them through `vmm_core` (`vmm_core::ipc_test`), which
//! re-exports them next to the runtime they expand to.

#![deny(missing_docs)]

use proc_macro::TokenStream;

mod expand;

/// Runs one test body in real child processes, once per start method: one `#[test]` per method.
///
/// ```no_run
/// use vmm_core::process::Context;
///
/// /// What `skip_unless` evaluates: `bool`, or `Result<(), impl Display>` (the `Err` is the reason
/// /// for skipping).
/// fn gpu_present() -> Result<(), String> {
///     Ok(())
/// }
///
/// #[vmm_core::ipc_test(methods = [spawn, forkserver, warm], skip_unless = gpu_present(), timeout = 60)]
/// fn child_reads_parent_pattern(ctx: &Context) {
///     // Start children with `ctx` and check what they see.
///     let _ = ctx;
/// }
/// # fn main() {}
/// ```
///
/// This defines the tests `child_reads_parent_pattern::spawn`,
/// `child_reads_parent_pattern::forkserver` and `child_reads_parent_pattern::warm` (prefixed with
/// the enclosing module's path), ordinary
/// `#[test]`s that `cargo test` and `cargo nextest` list, filter and run. The function keeps its
/// name, attributes and visibility; it is the body each generated test runs.
///
/// # The function
///
/// It takes exactly one parameter, the context, as a shared reference: `&Context`, where the type
/// is `vmm_core::process::Context` written as any path ending in `Context`
/// (`&vmm_core::process::Context`, `&Context`). It returns `()` or `Result<(), E>` with
/// `E: Debug` (an `Err` fails the test). It may not be `async`, `unsafe` or generic over types or
/// constants (lifetime parameters are fine).
///
/// `#[ignore]` / `#[ignore = "reason"]` and `#[should_panic]` on the function move to each
/// generated test; `#[cfg(..)]` applies to the function and to the generated tests alike.
///
/// # Options
///
/// All optional, in any order, each at most once:
///
/// - `methods = [spawn, forkserver, warm]`: the start methods to run under, one test each, in the
///   given order. Any non-empty subset, or `methods = all` for every one (the one list, shared
///   with [`macro@all_methods`]); the default is `[spawn, forkserver]`. `warm` takes its
///   children from the process's warm pool (`vmm_core::process::WarmPool::global()`: children started
///   ahead of need, CUDA initialised where there is a GPU, each still running one function);
///   its test fills the pool first (and, for a `thread_unsafe` test, waits until it is full, so
///   that an fd baseline taken in the body includes it). It is opt-in because waiting children
///   hold GPU memory.
/// - `skip_unless = EXPR`: evaluated at run time in the parent test process, before any child
///   starts; the test is skipped (passes without running the body) unless it is `true` or
///   `Ok(())`. With `VMM_REQUIRE_GPU=1` in the environment a skip fails the test instead. `EXPR` is a `bool` or a `Result<(), impl Display>`, typically
///   `vmm_core::testing::cuda_vmm_ipc()`.
/// - `thread_unsafe = "reason"`: the test runs alone: exclusive with every other `ipc_test` in
///   the test process (the others run concurrently). The reason (a non-empty string literal)
///   says why, e.g. `"sets CUDA_VISIBLE_DEVICES"`.
/// - `timeout = SECS`: an integer literal of seconds, at least 1; the test fails when the body
///   and its children run longer.
/// - `crate = PATH`: the path to vmm-core, for code that reaches it through another crate
///   that re-exports it (a facade: `crate = my_test_kit::vmm`). A path, not a string as in
///   serde's `#[serde(crate = "...")]`; it is written as it would be next to the function
///   (`crate::`, `self::`, `super::`, `::`, a crate's name or an import of the enclosing module).
///   Without it the macro finds vmm-core's name in the calling crate's `Cargo.toml` (as the
///   `proc-macro-crate` crate does), so a renamed dependency,
///   `vmm = { package = "vmm-core", .. }`, needs no option; where vmm-core is not listed
///   there, it uses `::vmm_core`.
///
/// ```no_run
/// use vmm_core::process::Context;
///
/// /// What a facade crate does: re-export vmm-core.
/// mod facade {
///     pub use vmm_core as vmm;
/// }
///
/// #[facade::vmm::ipc_test(crate = crate::facade::vmm)]
/// fn through_a_facade(ctx: &Context) {
///     let _ = ctx;
/// }
/// # fn main() {}
/// ```
///
/// # With rstest
///
/// Put `#[rstest]` (with its `#[case]`s) **above** `#[ipc_test]` and mark the context parameter
/// `#[ignore]`, so that rstest leaves it in the signature instead of looking for a fixture named
/// after it:
///
/// ```no_run
/// use rstest::rstest;
/// use vmm_core::process::Context;
///
/// #[rstest]
/// #[case(1)]
/// #[case::large(1 << 20)]
/// #[vmm_core::ipc_test(methods = [spawn, forkserver])]
/// fn roundtrip(#[ignore] ctx: &Context, #[case] len: usize) {
///     let _ = (ctx, len);
/// }
/// # fn main() {}
/// ```
///
/// One test per case per method: `roundtrip::case_1::spawn`, `roundtrip::case_1::forkserver`,
/// `roundtrip::case_2_large::spawn`, `roundtrip::case_2_large::forkserver`. `#[values]` work the
/// same way (`t::n_1_1::spawn`, ...). rstest copies `#[ipc_test]` onto each case function it
/// generates, ahead of that function's `#[test]`, which `#[ipc_test]` removes. The other order
/// (`#[ipc_test]` above `#[rstest]`) is an error: the case parameters are extra parameters.
///
/// # Expansion
///
/// ```ignore
/// #[vmm_core::ipc_test(methods = [spawn], skip_unless = gpu_present(), timeout = 60)]
/// fn child_reads_parent_pattern(ctx: &Context) { /* body */ }
/// ```
///
/// expands to (`__private` is not a public API; `::vmm_core` is the name vmm-core has in the
/// calling crate's `Cargo.toml`, or the `crate = PATH` given):
///
/// ```ignore
/// #[cfg_attr(not(test), allow(dead_code))]
/// fn child_reads_parent_pattern(ctx: &Context) { /* body */ }
///
/// #[allow(non_snake_case)]
/// mod child_reads_parent_pattern {
///     #[allow(unused_imports)]
///     use super::*; // only with `skip_unless`, or a `crate` path that starts with a plain name
///
///     #[test]
///     fn spawn() {
///         ::vmm_core::testing::__private::run(
///             ::vmm_core::testing::__private::Spec {
///                 module_path: ::core::module_path!(),
///                 function: "child_reads_parent_pattern",
///                 method: ::vmm_core::testing::__private::StartMethod::Spawn,
///                 timeout_secs: ::core::option::Option::Some(60u64),
///                 thread_unsafe: ::core::option::Option::None,
///             },
///             || ::vmm_core::testing::__private::Requirement::check(gpu_present()),
///             super::child_reads_parent_pattern,
///         )
///     }
/// }
/// ```
///
/// The body stays where it was written, so it resolves names (including `super::` paths) exactly
/// as an ordinary function there would. A function and a module of the same name live in
/// different namespaces, so both are `child_reads_parent_pattern`.
///
/// The `skip_unless` expression is evaluated inside the generated module, which glob-imports the
/// enclosing module: plain names and `crate::`/`::` paths resolve as written, but inside it the
/// names `spawn`, `forkserver` and `warm` are the generated tests and `super::` means the enclosing
/// module. Write `crate::` paths there if in doubt. (A `crate = PATH` needs no such care: it is
/// adjusted to resolve as written.)
///
/// # Errors
///
/// Compile errors point at the offending token: an unknown or repeated option, an unknown or
/// repeated method, an empty `methods` list, a literal of the wrong type (or a zero `timeout`,
/// an empty reason), a `crate` value that is not a path, a missing context parameter, extra
/// parameters, a context parameter that is not `&...Context` (by value, `&mut`, another type),
/// and `async`, `unsafe` or generic functions. All of them are reported at once. A `crate`
/// path that leads nowhere fails where the generated tests are compiled (test builds), at the
/// path as written.
#[proc_macro_attribute]
pub fn ipc_test(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::ipc_test(attr.into(), item.into()).into()
}

/// Run an [`rstest`](https://docs.rs/rstest) test under every start method: each parameter
/// marked `#[all_methods]` becomes `#[values(StartMethod::Spawn, StartMethod::Forkserver,
/// StartMethod::Warm)]` (the parameter's type as written, then each variant), so that the
/// list of start methods is written once, here, and the generated tests keep rstest's names
/// (`method_1_StartMethod__Spawn`, ...). Put it above `#[rstest]`.
///
/// ```
/// use rstest::rstest;
/// use vmm_core::process::StartMethod;
///
/// #[vmm_core::all_methods]
/// #[rstest]
/// fn runs_under(#[all_methods] method: StartMethod) {
///     assert!(StartMethod::ALL.contains(&method));
/// }
/// ```
///
/// `#[ipc_test]` says the same with `methods = all`.
#[proc_macro_attribute]
pub fn all_methods(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::all_methods(attr.into(), item.into()).into()
}
