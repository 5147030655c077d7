//! The attribute's options (`methods = [..]`, `skip_unless = ..`, ...): parsed, checked and
//! interpreted, with every error collected.

use proc_macro2::TokenStream;
use quote::{ToTokens, format_ident};
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream, Parser};
use syn::punctuated::Punctuated;
use syn::{Expr, ExprLit, ExprPath, Ident, Lit, LitStr, Path, PathArguments, Token};

use super::Errors;

/// The option names, in the order the documentation lists them.
const OPTIONS: &str = "`methods`, `skip_unless`, `thread_unsafe`, `timeout`, `crate`";

/// The valid method names, as error messages list them.
const METHODS: &str = "`spawn`, `forkserver` or `warm`";

/// A start method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Method {
    Spawn,
    Forkserver,
    Warm,
}

impl Method {
    /// The methods a test runs under when `methods` is not given, in this order. `warm` is
    /// opt-in: it keeps children waiting (with a CUDA context each, on a GPU machine).
    pub(super) const DEFAULT: [Method; 2] = [Method::Spawn, Method::Forkserver];

    /// Every start method, in the order of `vmm_core::process::StartMethod::ALL`: what
    /// `methods = all` and `#[all_methods]` run under. The one list of start methods the tests
    /// name.
    pub(super) const ALL: [Method; 3] = [Method::Spawn, Method::Forkserver, Method::Warm];

    fn from_name(name: &str) -> Option<Self> {
        match name {
            "spawn" => Some(Method::Spawn),
            "forkserver" => Some(Method::Forkserver),
            "warm" => Some(Method::Warm),
            _ => None,
        }
    }

    /// The generated test's name.
    pub(super) fn test_name(self) -> Ident {
        match self {
            Method::Spawn => format_ident!("spawn"),
            Method::Forkserver => format_ident!("forkserver"),
            Method::Warm => format_ident!("warm"),
        }
    }

    /// The `StartMethod` variant.
    pub(super) fn variant(self) -> Ident {
        match self {
            Method::Spawn => format_ident!("Spawn"),
            Method::Forkserver => format_ident!("Forkserver"),
            Method::Warm => format_ident!("Warm"),
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
pub(super) struct Options {
    pub(super) methods: Option<Vec<Method>>,
    pub(super) skip_unless: Option<Expr>,
    pub(super) thread_unsafe: Option<LitStr>,
    pub(super) timeout_secs: Option<u64>,
    /// The path to vmm-core as written (`crate = path`), resolved next to the function.
    pub(super) crate_path: Option<Path>,
}

pub(super) fn parse_options(attr: TokenStream, errors: &mut Errors) -> Options {
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
            "methods" | "skip_unless" | "thread_unsafe" | "timeout" | "crate"
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
            "timeout" => options.timeout_secs = parse_timeout(&value, errors),
            _ => options.crate_path = parse_crate_path(&value, errors),
        }
    }
    options
}

fn parse_methods(value: &Expr, errors: &mut Errors) -> Option<Vec<Method>> {
    if let Expr::Path(path) = value
        && path.attrs.is_empty()
        && path.qself.is_none()
        && path.path.is_ident("all")
    {
        return Some(Method::ALL.to_vec());
    }
    let Expr::Array(array) = value else {
        errors.spanned(
            value,
            "expected a list of start methods, e.g. `methods = [spawn, forkserver, warm]`, or `all`",
        );
        return None;
    };
    if array.elems.is_empty() {
        errors.spanned(
            array,
            format_args!("`methods` must name at least one start method: {METHODS}"),
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
                    format_args!("unknown start method `{ident}`; expected {METHODS}"),
                );
                ok = false;
            }
            None => {
                errors.spanned(elem, format_args!("expected a start method: {METHODS}"));
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

/// `crate = some::path`: a path without generic arguments. A string (serde's spelling,
/// `crate = "..."`) gets a hint: this option takes the path itself, so that it is checked,
/// resolved and spanned like any other path.
fn parse_crate_path(value: &Expr, errors: &mut Errors) -> Option<Path> {
    match value {
        Expr::Path(ExprPath {
            attrs,
            qself: None,
            path,
        }) if attrs.is_empty()
            && path
                .segments
                .iter()
                .all(|segment| matches!(segment.arguments, PathArguments::None)) =>
        {
            Some(path.clone())
        }
        Expr::Lit(ExprLit {
            lit: Lit::Str(string),
            ..
        }) => {
            let path = string.parse::<Path>().map_or_else(
                |_| "my_facade::vmm_core".to_owned(),
                |path| path.to_token_stream().to_string().replace(' ', ""),
            );
            errors.spanned(
                string,
                format_args!("`crate` takes a path, not a string: `crate = {path}` (no quotes)"),
            );
            None
        }
        _ => {
            errors.spanned(
                value,
                "expected the path to vmm-core, e.g. `crate = my_facade::vmm_core`",
            );
            None
        }
    }
}
