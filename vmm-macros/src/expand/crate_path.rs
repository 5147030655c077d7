//! The path through which the generated tests reach vmm-core.
//!
//! The generated code calls `<vmm-core>::testing::__private`. A crate may depend on vmm-core under
//! another name (`vmm = { package = "vmm-core", .. }`), so the name is looked up in the calling
//! crate's Cargo.toml (with `proc-macro-crate`) instead of assumed. A `crate = path` option
//! replaces the lookup: see [`in_generated_module`].

use proc_macro_crate::{Error, FoundCrate, crate_name};
use syn::{Ident, Path, PathSegment, parse_quote};

/// The package the generated code calls.
const PACKAGE: &str = "vmm-core";

/// The path used when the attribute has no `crate = path` option.
pub(crate) fn looked_up() -> Path {
    from_lookup(crate_name(PACKAGE))
}

/// `::name`, where `name` is what the calling crate's manifest calls vmm-core; `::vmm_core`
/// where that cannot be known.
///
/// `Itself` gives `::vmm_core` too, not `crate`: proc-macro-crate answers `Itself` for every
/// crate built from vmm-core's own manifest other than its integration tests and benches, so
/// also for vmm-core's doctests and examples, and those reach vmm-core as the dependency
/// `vmm_core` (their `crate` is the doctest or example). Only vmm-core's library itself could
/// use `crate`, and it would write `#[ipc_test(crate = crate)]`.
///
/// A failed lookup (built outside cargo; a manifest that names vmm-core only through a facade
/// crate) keeps the published name; a facade's users write `crate = facade::path`.
pub(crate) fn from_lookup(found: Result<FoundCrate, Error>) -> Path {
    let published = || parse_quote!(::vmm_core);
    match found {
        // proc-macro-crate makes the name an identifier (`-` becomes `_`); should it not parse
        // as one, the published name gives the clearer error.
        Ok(FoundCrate::Name(name)) => syn::parse_str::<Ident>(&name)
            .map_or_else(|_| published(), |name| parse_quote!(::#name)),
        Ok(FoundCrate::Itself) | Err(_) => published(),
    }
}

/// `path` as written next to the annotated function, made to resolve the same inside the
/// generated module (one level deeper).
///
/// Returns the path and whether the generated module needs `use super::*;` for it.
/// `::a` and `crate::a` resolve anywhere; `self::a` becomes `super::a`, `super::a` becomes
/// `super::super::a`; a path that starts with a plain name (an item or import of the enclosing
/// module, or a crate) keeps its form and is resolved through the glob import of the enclosing
/// module (crates resolve anywhere).
pub(crate) fn in_generated_module(mut path: Path) -> (Path, bool) {
    if path.leading_colon.is_some() {
        return (path, false);
    }
    let first = &mut path.segments[0].ident;
    if first == "crate" {
        (path, false)
    } else if first == "self" {
        *first = Ident::new("super", first.span());
        (path, false)
    } else if first == "super" {
        let outer = PathSegment::from(Ident::new("super", first.span()));
        path.segments.insert(0, outer);
        (path, false)
    } else {
        (path, true)
    }
}
