//! vmm-core's module graph, checked against the README's "Architecture" table: every top-level
//! module has a row, imports only the modules its row allows, and no two modules import each
//! other, directly or around a circle. Inside a module the same holds for files: no two files
//! of one module import each other around a circle, and each file of `cuda/` imports only files
//! its `mod.rs` Layout table lists before it. No two files share a name (`mod.rs` aside), so a
//! file's name alone says which one is meant.
//!
//! The sources and the README are embedded at build time (see `build.rs`), so this runs
//! wherever the test executable runs. An "import" is any path that leaves the module: `crate::x`
//! (in a `use` or inline, groups included), a `super::` chain that climbs out of the top-level
//! module, or a name the crate root re-exports (`crate::Error` is `error`'s). Comments, doc
//! links and string literals are not imports.

use std::collections::{BTreeMap, BTreeSet};

mod lexer;

use lexer::{code_only, tokens, tree_heads, tree_paths};

include!(concat!(env!("OUT_DIR"), "/sources.rs"));

/// Where an edge comes from: a file and line.
type Evidence = Vec<String>;

/// `from -> to -> where`.
type Graph = BTreeMap<String, BTreeMap<String, Evidence>>;

#[test]
fn every_module_imports_only_what_the_readme_table_allows() {
    let graph = module_graph(SOURCES);
    let table = architecture_table(README);
    let modules = top_level_modules(SOURCES);
    let mut problems = Vec::new();
    for module in &modules {
        if !table.contains_key(module) {
            problems.push(format!(
                "module `{module}` has no row in the README's Architecture table"
            ));
        }
    }
    for module in table.keys() {
        if !modules.contains(module) {
            problems.push(format!(
                "the README's Architecture table names `{module}`, which vmm-core does not have"
            ));
        }
    }
    for (from, edges) in &graph {
        let allowed = table.get(from).cloned().unwrap_or_default();
        for (to, evidence) in edges {
            if !allowed.contains(to) {
                problems.push(format!(
                    "`{from}` imports `{to}`, which its row does not allow (at {})",
                    places(evidence)
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn no_two_modules_import_each_other_around_a_circle() {
    assert_no_cycle(&module_graph(SOURCES), "import cycle");
}

/// Panic with `what` and each step of a cycle of `graph` (with where each import stands), if
/// it has one.
fn assert_no_cycle(graph: &Graph, what: &str) {
    if let Some(cycle) = find_cycle(graph) {
        let steps: Vec<String> = cycle
            .windows(2)
            .map(|pair| {
                let evidence = &graph[&pair[0]][&pair[1]];
                format!("{} -> {} (at {})", pair[0], pair[1], places(evidence))
            })
            .collect();
        panic!("{what}:\n{}", steps.join("\n"));
    }
}

#[test]
fn the_readme_table_is_a_layering() {
    let table = architecture_table(README);
    let as_graph: Graph = table
        .iter()
        .map(|(from, allowed)| {
            let edges = allowed
                .iter()
                .map(|to| (to.clone(), vec!["README".to_owned()]))
                .collect();
            (from.clone(), edges)
        })
        .collect();
    assert_eq!(
        find_cycle(&as_graph),
        None,
        "the table's may-import column goes around a circle"
    );
}

// ---- The scanner's own tests: each fails if the scanner misses an import or invents one. ----

#[test]
fn scanner_finds_use_groups_inline_paths_reexports_and_escaping_super_chains() {
    let sources: &[(&str, &str)] = &[
        (
            "lib.rs",
            "pub mod a; pub mod b; mod c; mod d; pub use c::{Thing, Other};",
        ),
        (
            "a/mod.rs",
            "use crate::{b::X, c::{self, Y}};\nfn f() { crate::d::g(); let _ = crate::Thing; }",
        ),
        (
            "a/deep/inner.rs",
            "use super::super::super::b::Z;\nuse super::super::x;",
        ),
        ("b.rs", "mod tests { use super::super::c::W; }"),
        ("c.rs", "fn f() -> Result<(), ()> { Ok(()) }"),
        ("d.rs", ""),
    ];
    let graph = module_graph(sources);
    let edges = |from: &str| -> Vec<&str> {
        graph
            .get(from)
            .map(|e| e.keys().map(String::as_str).collect())
            .unwrap_or_default()
    };
    assert_eq!(edges("a"), ["b", "c", "d"]);
    assert_eq!(edges("b"), ["c"]);
    assert!(edges("c").is_empty());
    assert_eq!(graph["a"]["b"], ["a/mod.rs:1", "a/deep/inner.rs:1"]);
}

#[test]
fn scanner_ignores_comments_strings_chars_and_doc_links() {
    let sources: &[(&str, &str)] = &[
        ("lib.rs", "pub mod a; pub mod b;"),
        (
            "a.rs",
            "//! See [`b`](crate::b).\n/* crate::b /* nested */ crate::b */\n\
             const S: &str = \"crate::b\"; const R: &str = r#\"crate::b \"# ;\n\
             const C: char = '\"'; fn f<'x>(_: &'x str) { let _ = \"\\\"crate::b\"; }",
        ),
        ("b.rs", ""),
    ];
    assert_eq!(module_graph(sources).get("a"), None);
}

#[test]
fn cycles_are_found_and_named() {
    let sources: &[(&str, &str)] = &[
        ("lib.rs", "mod a; mod b; mod c;"),
        ("a.rs", "use crate::b::X;"),
        ("b.rs", "use crate::c::Y;"),
        ("c.rs", "\n\nuse crate::a::Z;"),
    ];
    let graph = module_graph(sources);
    let cycle = find_cycle(&graph).expect("a -> b -> c -> a");
    assert_eq!(cycle, ["a", "b", "c", "a"]);
    assert_eq!(graph["c"]["a"], ["c.rs:3"]);
}

#[test]
fn the_table_parser_reads_names_and_permissions() {
    let readme = "# x\n\n## Architecture\n\nProse.\n\n| module | job | may import |\n\
                  |---|---|---|\n| `error` | errors | nothing |\n\
                  | `wire` | fds | `error`, `limits` |\n\n## Next\n| `zzz` | no | `a` |\n";
    let table = architecture_table(readme);
    assert_eq!(table.len(), 2);
    assert!(table["error"].is_empty());
    assert_eq!(
        table["wire"].iter().collect::<Vec<_>>(),
        ["error", "limits"]
    );
}

/// The first few places an edge comes from, and how many more there are.
fn places(evidence: &[String]) -> String {
    match evidence {
        [first, second, third, rest @ ..] if !rest.is_empty() => {
            format!("{first}, {second}, {third} and {} more", rest.len())
        }
        all => all.join(", "),
    }
}

// ---- The scanner ---------------------------------------------------------------------------

/// The top-level modules lib.rs declares.
fn top_level_modules(sources: &[(&str, &str)]) -> BTreeSet<String> {
    let lib = sources
        .iter()
        .find(|(path, _)| *path == "lib.rs")
        .map(|(_, text)| tokens(&code_only(text)))
        .expect("lib.rs is among the sources");
    lib.windows(3)
        .filter(|w| w[0].text == "mod" && w[2].text == ";")
        .map(|w| w[1].text.clone())
        .collect()
}

/// Names the crate root re-exports from a module: `pub use error::{Error, Result}` maps both
/// names to `error`.
fn root_reexports(
    sources: &[(&str, &str)],
    modules: &BTreeSet<String>,
) -> BTreeMap<String, String> {
    let lib = sources
        .iter()
        .find(|(path, _)| *path == "lib.rs")
        .map(|(_, text)| tokens(&code_only(text)))
        .expect("lib.rs is among the sources");
    let mut names = BTreeMap::new();
    for (i, token) in lib.iter().enumerate() {
        if token.text != "use" || i + 2 >= lib.len() || lib[i + 2].text != "::" {
            continue;
        }
        let module = &lib[i + 1].text;
        if !modules.contains(module) {
            continue;
        }
        for name in tree_heads(&lib, i + 3) {
            names.insert(name, module.clone());
        }
    }
    names
}

/// Every edge between top-level modules, with where it comes from.
fn module_graph(sources: &[(&str, &str)]) -> Graph {
    let modules = top_level_modules(sources);
    let reexports = root_reexports(sources, &modules);
    let resolve = |name: &str| -> Option<String> {
        if modules.contains(name) {
            Some(name.to_owned())
        } else {
            reexports.get(name).cloned()
        }
    };
    let mut graph = Graph::new();
    for_each_import(sources, |import| {
        let own = &import.module[0];
        if let Some(to) = import.target.first().and_then(|head| resolve(head))
            && to != *own
        {
            add_edge(&mut graph, own, to, &import);
        }
    });
    dedup_evidence(&mut graph);
    graph
}

/// One import of a source file, as [`for_each_import`] finds it.
struct Import<'a> {
    /// The file, e.g. `cuda/buffer.rs`.
    path: &'a str,
    /// Its module path, e.g. `cuda::buffer`.
    module: &'a [String],
    /// The path it names, from the crate root (a `super::` chain resolved against the file's
    /// module and the inline modules around it).
    target: Vec<String>,
    /// The line of its `crate` or first `super`.
    line: usize,
    /// Whether it sits inside an inline `#[cfg(test)] mod`.
    in_test: bool,
}

/// Every `crate::` and `super::` path of every source file but `lib.rs` (use trees expanded
/// into one path each): the one scanner both graphs are built from.
fn for_each_import(sources: &[(&str, &str)], mut each: impl FnMut(Import<'_>)) {
    for (path, text) in sources {
        if *path == "lib.rs" {
            continue;
        }
        let file_module = file_module_path(path);
        let tokens = tokens(&code_only(text));
        // Inline `mod name { ... }` blocks: (name, brace depth inside it, under `#[cfg(test)]`).
        let mut inline: Vec<(String, usize, bool)> = Vec::new();
        let mut depth = 0usize;
        let mut i = 0;
        while i < tokens.len() {
            let token = &tokens[i];
            match token.text.as_str() {
                "{" => depth += 1,
                "}" => {
                    if inline.last().is_some_and(|(_, d, _)| *d == depth) {
                        inline.pop();
                    }
                    depth = depth.saturating_sub(1);
                }
                "mod" if tokens.get(i + 2).is_some_and(|t| t.text == "{") => {
                    let cfg_test = i >= 7
                        && tokens[i - 7..i]
                            .iter()
                            .map(|t| t.text.as_str())
                            .eq(["#", "[", "cfg", "(", "test", ")", "]"]);
                    inline.push((tokens[i + 1].text.clone(), depth + 1, cfg_test));
                }
                _ => {}
            }
            let in_test = inline.iter().any(|(_, _, test)| *test);
            let starts_path = i == 0 || tokens[i - 1].text != "::";
            let next_is_path = tokens.get(i + 1).is_some_and(|t| t.text == "::");
            let mut targets = Vec::new();
            if starts_path && next_is_path && token.text == "crate" {
                targets = tree_paths(&tokens, i + 2);
            } else if starts_path && next_is_path && token.text == "super" {
                let mut here: Vec<String> = file_module.clone();
                here.extend(inline.iter().map(|(name, _, _)| name.clone()));
                let mut j = i;
                while tokens.get(j).is_some_and(|t| t.text == "super")
                    && tokens.get(j + 1).is_some_and(|t| t.text == "::")
                {
                    here.pop();
                    j += 2;
                }
                targets = tree_paths(&tokens, j)
                    .into_iter()
                    .map(|tail| here.iter().cloned().chain(tail).collect())
                    .collect();
                i = j - 1;
            }
            for target in targets {
                each(Import {
                    path,
                    module: &file_module,
                    target,
                    line: token.line,
                    in_test,
                });
            }
            i += 1;
        }
    }
}

/// The edge `from -> to`, with `import`'s place as its evidence.
fn add_edge(graph: &mut Graph, from: &str, to: String, import: &Import<'_>) {
    graph
        .entry(from.to_owned())
        .or_default()
        .entry(to)
        .or_default()
        .push(format!("{}:{}", import.path, import.line));
}

/// Each edge names each place once.
fn dedup_evidence(graph: &mut Graph) {
    for edges in graph.values_mut() {
        for evidence in edges.values_mut() {
            evidence.dedup();
        }
    }
}

/// `cuda/buffer.rs` is `cuda::buffer`; `cuda/mod.rs` is `cuda`.
fn file_module_path(path: &str) -> Vec<String> {
    let mut parts: Vec<String> = path
        .trim_end_matches(".rs")
        .split('/')
        .map(str::to_owned)
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

/// A circle in the graph, as `[a, b, .., a]`, if there is one.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &Graph,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|n| n == node) {
            let mut cycle = path[start..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flat_map(|e| e.keys()) {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

/// The README's Architecture table: module -> the modules it may import.
fn architecture_table(readme: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut table = BTreeMap::new();
    let mut inside = false;
    for line in readme.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            inside = heading.trim() == "Architecture";
            continue;
        }
        let line = line.trim();
        if !inside || !line.starts_with('|') {
            continue;
        }
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        let [name, _job, imports] = cells[..] else {
            continue;
        };
        let Some(name) = name.strip_prefix('`').and_then(|n| n.strip_suffix('`')) else {
            continue; // the header and the separator row
        };
        let allowed = imports
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect();
        table.insert(name.to_owned(), allowed);
    }
    table
}

#[test]
fn no_two_source_files_share_a_name() {
    let clashes = same_names(SOURCES.iter().map(|(path, _)| *path));
    assert!(
        clashes.is_empty(),
        "source files of vmm-core that share a name (name each after what it holds):\n{}",
        clashes
            .iter()
            .map(|(name, paths)| format!("{name}: {}", paths.join(", ")))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn same_names_finds_files_of_one_name_in_different_folders() {
    let clashes = same_names(
        [
            "a/mod.rs",
            "b/mod.rs",
            "a/handle.rs",
            "b/c/handle.rs",
            "lib.rs",
            "a/x.rs",
        ]
        .into_iter(),
    );
    assert_eq!(
        clashes,
        vec![(
            "handle.rs".to_owned(),
            vec!["a/handle.rs".to_owned(), "b/c/handle.rs".to_owned()]
        )]
    );
}

/// File names (not `mod.rs`, every module's root) that more than one of `paths` has, with
/// those paths.
fn same_names<'a>(paths: impl Iterator<Item = &'a str>) -> Vec<(String, Vec<String>)> {
    let mut by_name: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for path in paths {
        let name = path.rsplit('/').next().unwrap_or(path);
        if name != "mod.rs" {
            by_name
                .entry(name.to_owned())
                .or_default()
                .push(path.to_owned());
        }
    }
    by_name
        .into_iter()
        .filter(|(_, paths)| paths.len() > 1)
        .collect()
}

// ---- Files inside a module --------------------------------------------------------------------

#[test]
fn no_two_files_inside_a_module_import_each_other_around_a_circle() {
    assert_no_cycle(&file_graph(SOURCES), "import cycle between files");
}

#[test]
fn cuda_files_import_only_files_listed_before_them_in_its_layout() {
    let order = layout_order(SOURCES, "cuda/mod.rs");
    let graph = file_graph(SOURCES);
    let rank = |file: &str| -> Option<usize> {
        let name = file.strip_prefix("cuda::")?.split("::").next()?;
        order.iter().position(|listed| listed == name)
    };
    let mut problems = Vec::new();
    // `cuda/mod.rs` itself declares and re-exports; a file that imports through it is told to
    // name the file instead (`cuda` has no rank).
    for file in file_nodes(SOURCES) {
        if !file.starts_with("cuda::") {
            continue;
        }
        if rank(&file).is_none() {
            problems.push(format!("`{file}` has no row in cuda/mod.rs's Layout table"));
        }
    }
    let in_cuda = |file: &str| file == "cuda" || file.starts_with("cuda::");
    for (from, edges) in graph.iter().filter(|(from, _)| in_cuda(from)) {
        for (to, evidence) in edges {
            let ok = match (rank(from), rank(to)) {
                (Some(f), Some(t)) => t <= f,
                _ => false,
            };
            if !ok {
                problems.push(format!(
                    "`{from}` imports `{to}`, which cuda/mod.rs's Layout table does not list \
                     before it (at {})",
                    places(evidence)
                ));
            }
        }
    }
    assert!(!order.is_empty(), "cuda/mod.rs has a Layout table");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_layout_parser_reads_names_in_order() {
    let sources: &[(&str, &str)] = &[(
        "m/mod.rs",
        "//! Prose.\n//!\n//! | module | job |\n//! | --- | --- |\n//! | `low` | a |\n\
         //! | [`high`] | b, [`x`] |\n//!\n//! | `later` | other table |\nmod low;",
    )];
    assert_eq!(layout_order(sources, "m/mod.rs"), ["low", "high"]);
}

/// The names in the first table of a module file's `//!` docs, in order.
fn layout_order(sources: &[(&str, &str)], path: &str) -> Vec<String> {
    let text = sources
        .iter()
        .find(|(p, _)| *p == path)
        .map(|(_, text)| *text)
        .unwrap_or_default();
    let mut names = Vec::new();
    let mut started = false;
    for line in text.lines() {
        let Some(doc) = line.strip_prefix("//!") else {
            continue;
        };
        let doc = doc.trim();
        if !doc.starts_with('|') {
            if started {
                break;
            }
            continue;
        }
        started = true;
        let first = doc.trim_matches('|').split('|').next().unwrap_or("").trim();
        let name = first.trim_start_matches('[').trim_end_matches(']');
        if let Some(name) = name.strip_prefix('`').and_then(|n| n.strip_suffix('`')) {
            names.push(name.to_owned());
        }
    }
    names
}

#[test]
fn scanner_finds_file_cycles_inside_a_module() {
    let sources: &[(&str, &str)] = &[
        ("lib.rs", "pub mod m; mod other;"),
        (
            "m/mod.rs",
            "mod a; mod b; mod c; mod d; mod e;\npub use c::Reexported;\nuse crate::other::Q;",
        ),
        ("m/a.rs", "use super::b::X;\nuse crate::other::Y;"),
        ("m/b.rs", "use crate::m::{c::{self, Z}, d};"),
        // Closes a -> b -> c -> a. (A glob from a file's own inline module is the file itself.)
        (
            "m/c.rs",
            "fn f() { super::a::g(); }\nmod tests { use super::*; }",
        ),
        (
            "m/d.rs",
            // `super::Reexported` is `c`'s: the module file re-exports it from `c`.
            "use super::Reexported;\nmod inner { use super::super::e; }\n\
             #[cfg(test)]\nmod unit { use super::super::b; }",
        ),
        ("m/e.rs", ""),
        ("other.rs", "use crate::m::a::W;"),
    ];
    let graph = file_graph(sources);
    let edges = |from: &str| -> Vec<&str> {
        graph
            .get(from)
            .map(|e| e.keys().map(String::as_str).collect())
            .unwrap_or_default()
    };
    assert_eq!(edges("m::a"), ["m::b"]);
    assert_eq!(edges("m::b"), ["m::c", "m::d"]);
    assert_eq!(edges("m::c"), ["m::a"]);
    assert_eq!(
        edges("m::d"),
        ["m::c", "m::e"],
        "not `m::b`: only a unit test uses it"
    );
    assert!(
        edges("m").is_empty(),
        "a module file's `mod x;` and `pub use x::..` are not imports"
    );
    assert!(
        edges("other").is_empty(),
        "edges between modules are the module graph's"
    );
    assert_eq!(graph["m::c"]["m::a"], ["m/c.rs:1"]);
    let cycle = find_cycle(&graph).expect("m::a -> m::b -> m::c -> m::a");
    assert_eq!(cycle, ["m::a", "m::b", "m::c", "m::a"]);

    let broken: Vec<(&str, &str)> = sources
        .iter()
        .map(|&(path, text)| {
            if path == "m/c.rs" {
                (path, "")
            } else {
                (path, text)
            }
        })
        .collect();
    assert_eq!(find_cycle(&file_graph(&broken)), None);
}

/// Every source file as a node: `cuda/buffer/mod.rs` is `cuda::buffer`, `cuda/handle.rs` is
/// `cuda::handle`.
fn file_nodes(sources: &[(&str, &str)]) -> BTreeSet<String> {
    sources
        .iter()
        .filter(|(path, _)| *path != "lib.rs")
        .map(|(path, _)| file_module_path(path).join("::"))
        .collect()
}

/// For each module file (`mod.rs`): the names it re-exports from its own child files
/// (`pub use device::{Device, availability}` maps both names to `cuda::device`).
fn module_file_reexports(
    sources: &[(&str, &str)],
    files: &BTreeSet<String>,
) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut out: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for (path, text) in sources {
        if !path.ends_with("/mod.rs") {
            continue;
        }
        let module = file_module_path(path).join("::");
        let tokens = tokens(&code_only(text));
        for (i, token) in tokens.iter().enumerate() {
            if token.text != "use" || tokens.get(i + 2).is_none_or(|t| t.text != "::") {
                continue;
            }
            let child = format!("{module}::{}", tokens[i + 1].text);
            if !files.contains(&child) {
                continue;
            }
            for name in tree_heads(&tokens, i + 3) {
                out.entry(module.clone())
                    .or_default()
                    .insert(name, child.clone());
            }
        }
    }
    out
}

/// Every edge between two files of the same top-level module, with where it comes from. An
/// import is a `crate::` path or a `super::` chain, resolved to the deepest file it names; a name
/// a module file re-exports from one of its files is that file's. Imports inside an inline
/// `#[cfg(test)] mod` are left out (a unit test may use any file of its module); a module file's
/// `mod x;` and `pub use x::..` declare, they do not import.
fn file_graph(sources: &[(&str, &str)]) -> Graph {
    let files = file_nodes(sources);
    let reexports = module_file_reexports(sources, &files);
    let resolve = |path: &[String]| -> Option<String> {
        let mut found = None;
        for len in 1..=path.len() {
            let candidate = path[..len].join("::");
            if files.contains(&candidate) {
                found = Some(candidate);
            } else {
                break;
            }
        }
        let found = found?;
        let depth = found.split("::").count();
        Some(
            path.get(depth)
                .and_then(|next| reexports.get(&found)?.get(next))
                .cloned()
                .unwrap_or(found),
        )
    };
    let mut graph = Graph::new();
    for_each_import(sources, |import| {
        // A unit test may use any file of its module: its imports are not the file's.
        if import.in_test || import.target.first() != import.module.first() {
            return;
        }
        let own = import.module.join("::");
        if let Some(to) = resolve(&import.target)
            && to != own
        {
            add_edge(&mut graph, &own, to, &import);
        }
    });
    dedup_evidence(&mut graph);
    graph
}
