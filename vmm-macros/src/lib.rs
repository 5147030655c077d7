//! Procedural macros of vmm-ipc. Use them through `vmm_core` (`vmm_core::ipc_test`), which
//! re-exports them next to the runtime they expand to.

use proc_macro::TokenStream;

/// Placeholder until the `#[ipc_test]` issue lands: leaves the item unchanged.
#[proc_macro_attribute]
pub fn ipc_test(_attr: TokenStream, item: TokenStream) -> TokenStream {
    item
}
