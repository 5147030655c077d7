//! Procedural macros of vmm-ipc. Use them through `vmm_core` (`vmm_core::ipc_test`), which
//! re-exports them next to the runtime they expand to.

use proc_macro::TokenStream;

mod expand;

/// ipc_test docs (TODO)
#[proc_macro_attribute]
pub fn ipc_test(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::ipc_test(attr.into(), item.into()).into()
}
