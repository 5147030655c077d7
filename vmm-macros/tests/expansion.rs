//! The exact expansion, on token strings.
//!
//! The expansion module is compiled here as a plain module of this test crate rather than tested
//! inside the proc-macro crate: a proc-macro crate's own test binary links libstd dynamically, so
//! it cannot run where no Rust toolchain is installed (the GPU machine runs every staged test
//! binary).

#[path = "../src/expand/mod.rs"]
mod expansion;

use proc_macro_crate::{Error, FoundCrate};
use proc_macro2::TokenStream;
use quote::{ToTokens, quote};
use syn::{Path, parse_quote};

use expansion::crate_path::from_lookup;

/// The expansion with the real lookup of vmm-core's name. It reads this crate's manifest
/// (`CARGO_MANIFEST_DIR`, set by cargo and nextest), where vmm-core is the dev-dependency
/// `vmm_core`; a staged binary without it falls back to the same `::vmm_core`.
fn expand(attr: TokenStream, item: TokenStream) -> String {
    expansion::ipc_test(attr, item).to_string()
}

/// The expansion where the lookup would find `found`.
fn expand_finding(found: Path, attr: TokenStream, item: TokenStream) -> String {
    expansion::expand(attr, item, || found).to_string()
}

/// The expansion with a `crate = ..` option, which must win: the lookup is never made.
fn expand_with_option(attr: TokenStream) -> String {
    expansion::expand(
        attr,
        quote!(
            fn t(ctx: &Context) {}
        ),
        || panic!("the crate was looked up although `crate = ..` was given"),
    )
    .to_string()
}

#[test]
fn defaults_expand_to_spawn_then_forkserver() {
    let actual = expand(
        quote!(),
        quote! {
            /// Docs stay on the body.
            pub(crate) fn child_reads(ctx: &vmm_core::process::Context) { body(ctx) }
        },
    );
    let expected = quote! {
        #[cfg_attr(not(test), allow(dead_code))]
        /// Docs stay on the body.
        pub(crate) fn child_reads(ctx: &vmm_core::process::Context) { body(ctx) }

        #[allow(non_snake_case)]
        mod child_reads {
            #[test]
            fn spawn() {
                ::vmm_core::testing::__private::run(
                    ::vmm_core::testing::__private::Spec {
                        module_path: ::core::module_path!(),
                        function: "child_reads",
                        method: ::vmm_core::testing::__private::StartMethod::Spawn,
                        timeout_secs: ::core::option::Option::None,
                        thread_unsafe: ::core::option::Option::None,
                    },
                    || ::core::result::Result::Ok(()),
                    super::child_reads,
                )
            }
            #[test]
            fn forkserver() {
                ::vmm_core::testing::__private::run(
                    ::vmm_core::testing::__private::Spec {
                        module_path: ::core::module_path!(),
                        function: "child_reads",
                        method: ::vmm_core::testing::__private::StartMethod::Forkserver,
                        timeout_secs: ::core::option::Option::None,
                        thread_unsafe: ::core::option::Option::None,
                    },
                    || ::core::result::Result::Ok(()),
                    super::child_reads,
                )
            }
        }
    };
    assert_eq!(actual, expected.to_string());
}

#[test]
fn every_option() {
    let actual = expand(
        quote! {
            methods = [forkserver],
            skip_unless = vmm_core::testing::cuda_vmm_ipc(),
            thread_unsafe = "sets an env var",
            timeout = 30,
        },
        quote! {
            #[ignore = "slow"]
            #[cfg(feature = "cuda")]
            #[test]
            fn t(#[ignore] _ctx: &Context) -> Result<(), String> { Ok(()) }
        },
    );
    let expected = quote! {
        #[cfg_attr(not(test), allow(dead_code))]
        #[cfg(feature = "cuda")]
        fn t(_ctx: &Context) -> Result<(), String> { Ok(()) }

        #[cfg(feature = "cuda")]
        #[allow(non_snake_case)]
        mod t {
            #[allow(unused_imports)]
            use super::*;
            #[test]
            #[ignore = "slow"]
            fn forkserver() {
                ::vmm_core::testing::__private::run(
                    ::vmm_core::testing::__private::Spec {
                        module_path: ::core::module_path!(),
                        function: "t",
                        method: ::vmm_core::testing::__private::StartMethod::Forkserver,
                        timeout_secs: ::core::option::Option::Some(30u64),
                        thread_unsafe: ::core::option::Option::Some("sets an env var"),
                    },
                    || ::vmm_core::testing::__private::Requirement::check(
                        vmm_core::testing::cuda_vmm_ipc()
                    ),
                    super::t,
                )
            }
        }
    };
    assert_eq!(actual, expected.to_string());
}

#[test]
fn methods_keep_the_given_order() {
    let actual = expand(
        quote!(methods = [forkserver, spawn]),
        quote!(
            fn t(ctx: &Context) {}
        ),
    );
    let forkserver = actual.find("fn forkserver").expect("forkserver test");
    let spawn = actual.find("fn spawn").expect("spawn test");
    assert!(forkserver < spawn, "{actual}");
}

#[test]
fn warm_is_a_method_and_not_a_default() {
    let actual = expand(
        quote!(methods = [warm]),
        quote!(
            fn t(ctx: &Context) {}
        ),
    );
    assert!(actual.contains("fn warm ()"), "{actual}");
    assert!(
        actual.contains(":: vmm_core :: testing :: __private :: StartMethod :: Warm"),
        "{actual}"
    );
    assert!(!actual.contains("fn spawn"), "{actual}");
    let default = expand(
        quote!(),
        quote!(
            fn t(ctx: &Context) {}
        ),
    );
    assert!(!default.contains("Warm"), "{default}");
    let unknown = expand(
        quote!(methods = [spawn, cold]),
        quote!(
            fn t(ctx: &Context) {}
        ),
    );
    assert!(
        unknown.contains("unknown start method `cold`; expected `spawn`, `forkserver` or `warm`"),
        "{unknown}"
    );
}

#[test]
fn errors_are_combined_and_keep_only_inert_attributes() {
    let actual = expand(
        quote!(retries = 3, timeout = 0),
        quote! {
            /// Docs.
            #[rstest]
            async fn t(#[case] n: u32) {}
        },
    );
    for message in [
        "unknown option `retries`",
        "`timeout` must be at least 1 second",
        "does not support `async fn`",
        "the context parameter must be a shared reference",
    ] {
        assert!(
            actual.contains(message),
            "{message:?} missing from {actual}"
        );
    }
    assert!(!actual.contains("rstest"), "{actual}");
    assert!(!actual.contains("case"), "{actual}");
    assert!(actual.contains("# [allow (dead_code)]"), "{actual}");
}

#[test]
fn a_renamed_dependency_is_called_by_its_name() {
    let actual = expand_finding(
        parse_quote!(::vmm),
        quote!(),
        quote!(
            fn t(ctx: &Context) {}
        ),
    );
    assert!(
        actual.contains(":: vmm :: testing :: __private :: run"),
        "{actual}"
    );
    assert!(!actual.contains("vmm_core"), "{actual}");
}

#[test]
fn lookup_results_map_to_paths() {
    let path = |found| from_lookup(found).to_token_stream().to_string();
    assert_eq!(path(Ok(FoundCrate::Name("vmm".into()))), ":: vmm");
    assert_eq!(path(Ok(FoundCrate::Name("vmm_core".into()))), ":: vmm_core");
    // vmm-core's own doctests and examples get `Itself` too, and reach it as `vmm_core`.
    assert_eq!(path(Ok(FoundCrate::Itself)), ":: vmm_core");
    assert_eq!(path(Err(Error::CargoManifestDirNotSet)), ":: vmm_core");
    // Not an identifier: the published name, whose error is the clearer one.
    assert_eq!(
        path(Ok(FoundCrate::Name("not a name".into()))),
        ":: vmm_core"
    );
}

#[test]
fn the_crate_option_wins_over_the_lookup() {
    let actual = expand_with_option(quote!(crate = ::facade::vmm, methods = [spawn]));
    let expected = quote! {
        #[cfg_attr(not(test), allow(dead_code))]
        fn t(ctx: &Context) {}

        #[allow(non_snake_case)]
        mod t {
            #[test]
            fn spawn() {
                ::facade::vmm::testing::__private::run(
                    ::facade::vmm::testing::__private::Spec {
                        module_path: ::core::module_path!(),
                        function: "t",
                        method: ::facade::vmm::testing::__private::StartMethod::Spawn,
                        timeout_secs: ::core::option::Option::None,
                        thread_unsafe: ::core::option::Option::None,
                    },
                    || ::core::result::Result::Ok(()),
                    super::t,
                )
            }
        }
    };
    assert_eq!(actual, expected.to_string());
}

/// The path is written next to the function; the tests live one module deeper.
#[test]
fn crate_paths_resolve_as_written_next_to_the_function() {
    const GLOB: &str = "use super :: * ;";
    for (written, generated, glob) in [
        (quote!(::facade::vmm), ":: facade :: vmm :: testing", false),
        (
            quote!(crate::facade::vmm),
            "crate :: facade :: vmm :: testing",
            false,
        ),
        (quote!(crate), "crate :: testing", false),
        (
            quote!(self::facade::vmm),
            "super :: facade :: vmm :: testing",
            false,
        ),
        (
            quote!(super::facade::vmm),
            "super :: super :: facade :: vmm :: testing",
            false,
        ),
        // An item or import of the enclosing module, or a crate: found through the glob.
        (quote!(facade::vmm), "facade :: vmm :: testing", true),
        (quote!(vmm), "vmm :: testing", true),
    ] {
        let actual = expand_with_option(quote!(crate = #written));
        let run = format!("{generated} :: __private :: run");
        assert!(
            actual.contains(&run),
            "{written}: {run:?} missing from {actual}"
        );
        assert_eq!(actual.contains(GLOB), glob, "{written}: {actual}");
    }
}

#[test]
fn crate_option_errors() {
    for (attr, message) in [
        (
            quote!(crate = "vmm"),
            "`crate` takes a path, not a string: `crate = vmm` (no quotes)",
        ),
        (
            quote!(crate = "::a::b c"),
            "`crate` takes a path, not a string: `crate = my_facade::vmm_core` (no quotes)",
        ),
        (quote!(crate = 1), "expected the path to vmm-core, e.g."),
        (
            quote!(crate = vmm::<u8>),
            "expected the path to vmm-core, e.g.",
        ),
        (
            quote!(crate = a, crate = b),
            "option `crate` is given more than once",
        ),
    ] {
        let actual = expand_with_option(attr.clone());
        assert!(
            actual.contains(message),
            "{attr}: {message:?} missing from {actual}"
        );
    }
}

#[test]
fn all_methods_gives_each_marked_parameter_every_start_method() {
    let expanded = expansion::all_methods(
        TokenStream::new(),
        quote!(
            #[rstest]
            fn t(#[all_methods] outer: StartMethod, n: u32, #[all_methods] inner: StartMethod) {}
        ),
    );
    let expected = quote!(
        #[rstest]
        fn t(
            #[values(StartMethod::Spawn, StartMethod::Forkserver, StartMethod::Warm)]
            outer: StartMethod,
            n: u32,
            #[values(StartMethod::Spawn, StartMethod::Forkserver, StartMethod::Warm)]
            inner: StartMethod,
        ) {
        }
    );
    // rustfmt puts a trailing comma after the last parameter of `expected`.
    assert_eq!(
        expanded.to_string(),
        expected.to_string().replace(" ,)", ")")
    );
}

#[test]
fn all_methods_refuses_arguments_and_a_function_with_no_marked_parameter() {
    let item = quote!(
        fn t(method: StartMethod) {}
    );
    let unmarked = expansion::all_methods(TokenStream::new(), item.clone()).to_string();
    assert!(unmarked.contains("marks no parameter"), "{unmarked}");
    let with_argument = expansion::all_methods(quote!(spawn), item).to_string();
    assert!(
        with_argument.contains("takes no arguments"),
        "{with_argument}"
    );
}

#[test]
fn methods_all_expands_to_every_start_method() {
    let all = expand(
        quote!(methods = all),
        quote!(
            fn t(ctx: &Context) {}
        ),
    );
    let listed = expand(
        quote!(methods = [spawn, forkserver, warm]),
        quote!(
            fn t(ctx: &Context) {}
        ),
    );
    assert_eq!(all, listed);
}
