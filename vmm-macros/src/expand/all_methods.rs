//! `#[all_methods]`: the one list of start methods, for rstest parameters.

use proc_macro2::TokenStream;
use quote::{ToTokens, quote};
use syn::{FnArg, ItemFn, parse_quote};

use super::options::Method;

/// The expansion of `#[all_methods] item`: every parameter of `item` marked `#[all_methods]`
/// gets `#[values(T::Spawn, T::Forkserver, T::Warm)]` instead (one value per
/// [`Method::ALL`], `T` its type as written), for the `#[rstest]` below to expand.
pub(crate) fn all_methods(attr: TokenStream, item: TokenStream) -> TokenStream {
    if !attr.is_empty() {
        return syn::Error::new_spanned(attr, "#[all_methods] takes no arguments")
            .to_compile_error();
    }
    let mut function: ItemFn = match syn::parse2(item) {
        Ok(function) => function,
        Err(error) => return error.to_compile_error(),
    };
    let mut marked = 0;
    for input in &mut function.sig.inputs {
        let FnArg::Typed(param) = input else { continue };
        let before = param.attrs.len();
        param
            .attrs
            .retain(|attr| !attr.path().is_ident("all_methods"));
        if param.attrs.len() == before {
            continue;
        }
        marked += 1;
        let ty = &param.ty;
        let values = Method::ALL.iter().map(|method| {
            let variant = method.variant();
            quote!(#ty::#variant)
        });
        param.attrs.push(parse_quote!(#[values(#(#values),*)]));
    }
    if marked == 0 {
        return syn::Error::new_spanned(
            &function.sig,
            "#[all_methods] marks no parameter: put `#[all_methods]` on the `StartMethod` \
             parameter(s) as well",
        )
        .to_compile_error();
    }
    function.into_token_stream()
}
