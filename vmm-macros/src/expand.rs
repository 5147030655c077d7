//! Parsing, validation and code generation of `#[ipc_test]`, on `proc_macro2` tokens so that it
//! can be unit-tested.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, format_ident, quote};
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream, Parser};
use syn::punctuated::Punctuated;
use syn::{Attribute, Expr, FnArg, Ident, ItemFn, Lit, LitStr, Token, Type, TypePath, parse_quote};

/// The option names, in the order the documentation lists them.
const OPTIONS: &str = "`methods`, `skip_unless`, `thread_unsafe`, `timeout`";

/// A start method, in the order the default `methods` list has them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    Spawn,
    Forkserver,
}

impl Method {
    const ALL: [Method; 2] = [Method::Spawn, Method::Forkserver];

    fn from_name(name: &str) -> Option<Self> {
        match name {
            "spawn" => Some(Method::Spawn),
            "forkserver" => Some(Method::Forkserver),
            _ => None,
        }
    }

    /// The generated test's name.
    fn test_name(self) -> Ident {
        match self {
            Method::Spawn => format_ident!("spawn"),
            Method::Forkserver => format_ident!("forkserver"),
        }
    }

    /// The `StartMethod` variant.
    fn variant(self) -> Ident {
        match self {
            Method::Spawn => format_ident!("Spawn"),
            Method::Forkserver => format_ident!("Forkserver"),
        }
    }
}

/// One `name = value` of the attribute, before it is interpreted.
struct RawOption {
    name: Ident,
    value: Expr,
}

impl Parse for RawOption {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let name = input.call(Ident::parse_any)?;
        input.parse::<Token![=]>()?;
        let value = input.parse()?;
        Ok(RawOption { name, value })
    }
}

/// The interpreted options.
#[derive(Default)]
struct Options {
    methods: Option<Vec<Method>>,
    skip_unless: Option<Expr>,
    thread_unsafe: Option<LitStr>,
    timeout_secs: Option<u64>,
}

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

fn parse_options(attr: TokenStream, errors: &mut Errors) -> Options {
    let mut options = Options::default();
    let raw = match Punctuated::<RawOption, Token![,]>::parse_terminated.parse2(attr) {
        Ok(raw) => raw,
        Err(error) => {
            errors.push(error);
            return options;
        }
    };
    let mut seen: Vec<String> = Vec::new();
    for RawOption { name, value } in raw {
        let key = name.to_string();
        if !matches!(
            key.as_str(),
            "methods" | "skip_unless" | "thread_unsafe" | "timeout"
        ) {
            errors.spanned(
                &name,
                format_args!("unknown option `{key}`; expected one of {OPTIONS}"),
            );
            continue;
        }
        if seen.contains(&key) {
            errors.spanned(
                &name,
                format_args!("option `{key}` is given more than once"),
            );
            continue;
        }
        seen.push(key.clone());
        match key.as_str() {
            "methods" => options.methods = parse_methods(&value, errors),
            "skip_unless" => options.skip_unless = Some(value),
            "thread_unsafe" => options.thread_unsafe = parse_reason(&value, errors),
            _ => options.timeout_secs = parse_timeout(&value, errors),
        }
    }
    options
}

fn parse_methods(value: &Expr, errors: &mut Errors) -> Option<Vec<Method>> {
    let Expr::Array(array) = value else {
        errors.spanned(
            value,
            "expected a list of start methods, e.g. `methods = [spawn, forkserver]`",
        );
        return None;
    };
    if array.elems.is_empty() {
        errors.spanned(
            array,
            "`methods` must name at least one start method: `spawn`, `forkserver`",
        );
        return None;
    }
    let mut methods = Vec::new();
    let mut ok = true;
    for elem in &array.elems {
        let method = match elem {
            Expr::Path(path) if path.attrs.is_empty() && path.qself.is_none() => path
                .path
                .get_ident()
                .map(|ident| (ident, Method::from_name(&ident.to_string()))),
            _ => None,
        };
        match method {
            Some((_, Some(method))) if methods.contains(&method) => {
                errors.spanned(elem, "start method is listed more than once");
                ok = false;
            }
            Some((_, Some(method))) => methods.push(method),
            Some((ident, None)) => {
                errors.spanned(
                    elem,
                    format_args!(
                        "unknown start method `{ident}`; expected `spawn` or `forkserver`"
                    ),
                );
                ok = false;
            }
            None => {
                errors.spanned(elem, "expected a start method: `spawn` or `forkserver`");
                ok = false;
            }
        }
    }
    ok.then_some(methods)
}

fn literal(value: &Expr) -> Option<&Lit> {
    match value {
        Expr::Lit(lit) if lit.attrs.is_empty() => Some(&lit.lit),
        _ => None,
    }
}

fn parse_reason(value: &Expr, errors: &mut Errors) -> Option<LitStr> {
    match literal(value) {
        Some(Lit::Str(reason)) if reason.value().trim().is_empty() => {
            errors.spanned(
                reason,
                "`thread_unsafe` needs a non-empty reason: why this test must run alone",
            );
            None
        }
        Some(Lit::Str(reason)) => Some(reason.clone()),
        _ => {
            errors.spanned(
                value,
                "expected a string literal: `thread_unsafe = \"why this test must run alone\"`",
            );
            None
        }
    }
}

fn parse_timeout(value: &Expr, errors: &mut Errors) -> Option<u64> {
    let Some(Lit::Int(secs)) = literal(value) else {
        errors.spanned(
            value,
            "expected an integer literal (seconds): `timeout = 60`",
        );
        return None;
    };
    if !matches!(secs.suffix(), "" | "u64") {
        errors.spanned(secs, "expected an unsuffixed integer literal (seconds)");
        return None;
    }
    match secs.base10_parse::<u64>() {
        Ok(0) => {
            errors.spanned(secs, "`timeout` must be at least 1 second");
            None
        }
        Ok(secs) => Some(secs),
        Err(error) => {
            errors.push(error);
            None
        }
    }
}

fn attr_is(attr: &Attribute, name: &str) -> bool {
    attr.path().is_ident(name)
}

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

fn check_signature(item: &mut ItemFn, errors: &mut Errors) {
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
    let private = quote!(::vmm_core::testing::__private);
    let none = quote!(::core::option::Option::None);
    let timeout_secs = match options.timeout_secs {
        Some(secs) => quote!(::core::option::Option::Some(#secs)),
        None => none.clone(),
    };
    let thread_unsafe = match &options.thread_unsafe {
        Some(reason) => quote!(::core::option::Option::Some(#reason)),
        None => none,
    };
    let (glob, requirement) = match &options.skip_unless {
        Some(expr) => (
            // The requirement is written in the scope of the annotated function.
            quote! {
                #[allow(unused_imports)]
                use super::*;
            },
            quote!(|| #private::Requirement::check(#expr)),
        ),
        None => (
            TokenStream::new(),
            quote!(|| ::core::result::Result::Ok(())),
        ),
    };
    let body = quote_spanned_path(name);
    let tests = options
        .methods
        .unwrap_or_else(|| Method::ALL.to_vec())
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
