//! The exact expansion, on token strings.
//!
//! The expansion module is compiled here as a plain module of this test crate rather than tested
//! inside the proc-macro crate: a proc-macro crate's own test binary links libstd dynamically, so
//! it cannot run where no Rust toolchain is installed (the GPU machine runs every staged test
//! binary).

#[path = "../src/expand/mod.rs"]
mod expansion;

use proc_macro2::TokenStream;
use quote::quote;

fn expand(attr: TokenStream, item: TokenStream) -> String {
    expansion::ipc_test(attr, item).to_string()
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
