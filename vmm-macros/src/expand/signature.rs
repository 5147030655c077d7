//! The annotated function's signature: exactly one `&Context` parameter, no `async`, `unsafe`
//! or generics.

use quote::{ToTokens, quote};
use syn::{FnArg, ItemFn, Type, TypePath};

use super::{Errors, attr_is};

/// `&...Context` (shared reference to a path whose last segment is `Context`, without generic
/// arguments).
fn is_context_path(ty: &Type) -> bool {
    match ty {
        Type::Path(TypePath { qself: None, path }) => path
            .segments
            .last()
            .is_some_and(|last| last.ident == "Context" && last.arguments.is_none()),
        Type::Group(group) => is_context_path(&group.elem),
        Type::Paren(paren) => is_context_path(&paren.elem),
        _ => false,
    }
}

fn is_context_ref(arg: &FnArg) -> bool {
    match arg {
        FnArg::Typed(typed) => match &*typed.ty {
            Type::Reference(reference) => {
                reference.mutability.is_none() && is_context_path(&reference.elem)
            }
            _ => false,
        },
        FnArg::Receiver(_) => false,
    }
}

/// Reports why `arg`, the only candidate for the context parameter, is not `&Context`.
fn report_bad_context(arg: &FnArg, errors: &mut Errors) {
    const EXPECTED: &str = "the context parameter must be a shared reference to \
                            `vmm_core::process::Context`, e.g. `ctx: &Context`";
    match arg {
        FnArg::Receiver(receiver) => errors.spanned(
            receiver,
            "#[ipc_test] does not support methods; the test takes `ctx: &Context`",
        ),
        FnArg::Typed(typed) => match &*typed.ty {
            Type::Reference(reference) => match reference.mutability {
                Some(mutability) => errors.spanned(
                    mutability,
                    "the context parameter must be a shared reference: `&Context`, not `&mut Context`",
                ),
                None => errors.spanned(&reference.elem, EXPECTED),
            },
            ty if is_context_path(ty) => errors.spanned(
                ty,
                "the context parameter must be taken by reference: `&Context`",
            ),
            ty => errors.spanned(ty, EXPECTED),
        },
    }
}

pub(super) fn check_signature(item: &mut ItemFn, errors: &mut Errors) {
    let sig = &mut item.sig;
    if let Some(asyncness) = &sig.asyncness {
        errors.spanned(
            asyncness,
            "#[ipc_test] does not support `async fn`; the test body runs synchronously",
        );
    }
    if let Some(unsafety) = &sig.unsafety {
        errors.spanned(unsafety, "#[ipc_test] does not support `unsafe fn`");
    }
    if sig.generics.type_params().next().is_some() || sig.generics.const_params().next().is_some() {
        errors.spanned(
            &sig.generics,
            "#[ipc_test] does not support generic functions (lifetime parameters are fine)",
        );
    } else if let Some(where_clause) = &sig.generics.where_clause {
        errors.spanned(
            where_clause,
            "#[ipc_test] does not support generic functions (no `where` clause)",
        );
    }
    if let Some(variadic) = &sig.variadic {
        errors.spanned(variadic, "#[ipc_test] does not support variadic functions");
    }

    if sig.inputs.is_empty() {
        errors.push(syn::Error::new(
            sig.paren_token.span.join(),
            "missing context parameter: an #[ipc_test] function takes `ctx: &Context` \
             (vmm_core::process::Context)",
        ));
        return;
    }
    let context = sig.inputs.iter().position(is_context_ref);
    if context.is_none() {
        report_bad_context(&sig.inputs[0], errors);
    }
    let context = context.unwrap_or(0);
    for (index, arg) in sig.inputs.iter_mut().enumerate() {
        if index == context {
            // rstest removes `#[ignore]` from the arguments it leaves alone; accept it here too.
            if let FnArg::Typed(typed) = arg {
                typed.attrs.retain(|attr| !attr_is(attr, "ignore"));
            }
            continue;
        }
        // Span the parameter without its attributes (`#[case]` etc.).
        let spanned = match &*arg {
            FnArg::Typed(typed) => {
                let (pat, colon, ty) = (&typed.pat, &typed.colon_token, &typed.ty);
                quote!(#pat #colon #ty)
            }
            FnArg::Receiver(receiver) => receiver.to_token_stream(),
        };
        errors.spanned(
            spanned,
            "extra parameter: an #[ipc_test] function takes only `ctx: &Context`; to add \
             parameters with rstest, put `#[rstest]` above `#[ipc_test]` and mark the context \
             parameter `#[ignore]`",
        );
    }
}
