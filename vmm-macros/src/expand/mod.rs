//! Parsing, validation and code generation of `#[ipc_test]`, on `proc_macro2` tokens so that it
//! can be unit-tested.

mod all_methods;
pub(crate) mod crate_path;
mod options;
mod signature;

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote};
use syn::{Attribute, FnArg, Ident, ItemFn, LitStr, Path, parse_quote};

pub(crate) use all_methods::all_methods;
use options::{Method, parse_options};
use signature::check_signature;

/// Collects errors so that one expansion reports all of them.
#[derive(Default)]
struct Errors(Option<syn::Error>);

impl Errors {
    fn push(&mut self, error: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }

    fn spanned(&mut self, tokens: impl ToTokens, message: impl std::fmt::Display) {
        self.push(syn::Error::new_spanned(tokens, message));
    }
}

fn attr_is(attr: &Attribute, name: &str) -> bool {
    attr.path().is_ident(name)
}

/// Attributes that belong on the generated `#[test]` functions rather than on the body function.
fn is_test_attr(attr: &Attribute) -> bool {
    attr_is(attr, "ignore") || attr_is(attr, "should_panic")
}

/// Attributes that neither expand nor affect the generated tests.
fn is_inert(attr: &Attribute) -> bool {
    ["doc", "cfg", "allow", "warn", "deny", "forbid", "expect"]
        .iter()
        .any(|name| attr_is(attr, name))
}

/// The expansion of `#[ipc_test(attr)] item`.
pub(crate) fn ipc_test(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand(attr, item, crate_path::looked_up)
}

/// [`ipc_test`], with the lookup of vmm-core's name in the calling crate's manifest passed in
/// (tests pass what it would find). It runs only when no `crate = path` option is given.
pub(crate) fn expand(
    attr: TokenStream,
    item: TokenStream,
    look_up_crate: impl FnOnce() -> Path,
) -> TokenStream {
    let mut item: ItemFn = match syn::parse2(item) {
        Ok(item) => item,
        Err(error) => return error.into_compile_error(),
    };
    let mut errors = Errors::default();
    let options = parse_options(attr, &mut errors);
    check_signature(&mut item, &mut errors);

    // `#[test]` is dropped: rstest puts it after the attributes it forwards, so a case function
    // reaches this macro still carrying it.
    item.attrs.retain(|attr| !attr_is(attr, "test"));

    if let Some(error) = errors.0 {
        // Keep the function so that uses of it do not cascade into more errors.
        // Only inert attributes stay: other attribute macros (e.g. rstest placed below
        // `#[ipc_test]`) would expand again and report errors of their own.
        let error = error.into_compile_error();
        item.attrs.retain(is_inert);
        for arg in &mut item.sig.inputs {
            if let FnArg::Typed(typed) = arg {
                typed.attrs.retain(is_inert);
            }
        }
        item.attrs.push(parse_quote!(#[allow(dead_code)]));
        return quote! { #error #item };
    }

    let (test_attrs, fn_attrs): (Vec<Attribute>, Vec<Attribute>) =
        item.attrs.drain(..).partition(is_test_attr);
    item.attrs = fn_attrs;
    let cfgs: Vec<&Attribute> = item
        .attrs
        .iter()
        .filter(|attr| attr_is(attr, "cfg"))
        .collect();

    let name = &item.sig.ident;
    let function = LitStr::new(&name.to_string(), name.span());
    let (krate, crate_needs_glob) = match options.crate_path {
        Some(path) => crate_path::in_generated_module(path),
        None => (look_up_crate(), false),
    };
    let private = quote!(#krate::testing::__private);
    let none = quote!(::core::option::Option::None);
    let timeout_secs = match options.timeout_secs {
        Some(secs) => quote!(::core::option::Option::Some(#secs)),
        None => none.clone(),
    };
    let thread_unsafe = match &options.thread_unsafe {
        Some(reason) => quote!(::core::option::Option::Some(#reason)),
        None => none,
    };
    let requirement = match &options.skip_unless {
        Some(expr) => quote!(|| #private::Requirement::check(#expr)),
        None => quote!(|| ::core::result::Result::Ok(())),
    };
    // The requirement, and a `crate` path that starts with a plain name, are written in the
    // scope of the annotated function.
    let glob = if options.skip_unless.is_some() || crate_needs_glob {
        quote! {
            #[allow(unused_imports)]
            use super::*;
        }
    } else {
        TokenStream::new()
    };
    let body = quote_spanned_path(name);
    let tests = options
        .methods
        .unwrap_or_else(|| Method::DEFAULT.to_vec())
        .into_iter()
        .map(|method| {
            let test = method.test_name();
            let variant = method.variant();
            quote! {
                #[test]
                #(#test_attrs)*
                fn #test() {
                    #private::run(
                        #private::Spec {
                            module_path: ::core::module_path!(),
                            function: #function,
                            method: #private::StartMethod::#variant,
                            timeout_secs: #timeout_secs,
                            thread_unsafe: #thread_unsafe,
                        },
                        #requirement,
                        #body,
                    )
                }
            }
        });

    quote! {
        #[cfg_attr(not(test), allow(dead_code))]
        #item

        #(#cfgs)*
        #[allow(non_snake_case)]
        mod #name {
            #glob
            #(#tests)*
        }
    }
}

/// `super::name`, spanned at the function's name so that type errors about the body function
/// (e.g. its return type) point there.
fn quote_spanned_path(name: &Ident) -> TokenStream {
    let span: Span = name.span();
    let super_ = Ident::new("super", span);
    quote!(#super_::#name)
}
