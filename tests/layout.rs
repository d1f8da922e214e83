//! The crate's top-level modules import one another without a cycle (docs: README,
//! "Architecture"): each data flow is one path through the folders, and shared code (`config`,
//! `signature`, `sender`, `logging`, `clock`, `locks`, `secret`, `schema`, `template`, `tls`, `operator`, `output`) never imports the
//! layers that use it. A `use crate::…` that closes a loop fails here with the loop named.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level module → the top-level modules its files name as `crate::NAME`.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut pending = vec![src.clone()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            if path.extension().is_none_or(|ext| ext != "rs") {
                continue;
            }
            let relative = path.strip_prefix(&src).expect("under src");
            let first = relative.components().next().expect("a component");
            let module = first
                .as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string();
            let text = std::fs::read_to_string(&path).expect("read a source file");
            // Unit tests may reach anywhere; only the code counts.
            let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
            let targets = graph.entry(module.clone()).or_default();
            targets.extend(
                modules_named(code)
                    .into_iter()
                    .filter(|name| *name != module),
            );
        }
    }
    graph
}

/// The top-level modules `code` names as `crate::NAME`, also inside a grouped import
/// (`use crate::{a, b::{c, d}}` names `a` and `b`).
fn modules_named(code: &str) -> BTreeSet<String> {
    let identifier = |text: &str| -> String {
        text.trim_start()
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect()
    };
    let mut names = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        let Some(group) = rest.trim_start().strip_prefix('{') else {
            names.insert(identifier(rest));
            continue;
        };
        // The group's top-level items, up to its closing brace.
        let (mut depth, mut item_start) = (0usize, 0usize);
        for (offset, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    names.insert(identifier(&group[item_start..offset]));
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    names.insert(identifier(&group[item_start..offset]));
                    item_start = offset + 1;
                }
                _ => {}
            }
        }
    }
    // `crate::{self, …}` names the crate itself; a trailing comma leaves an empty item.
    names.retain(|name| !name.is_empty() && name != "self");
    names
}

#[test]
fn grouped_imports_name_every_module_they_import() {
    let names = modules_named(
        "use crate::{logging, metrics};\nuse crate::{\n    self,\n    store::{Store, model::{A, B}},\n    session::Sessions,\n};\nfn f() { crate::cli::run() }",
    );
    let expected: BTreeSet<String> = ["cli", "logging", "metrics", "session", "store"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(names, expected);
}

/// A cycle through `start`, if there is one (depth-first search over the import graph).
fn cycle_through(graph: &BTreeMap<String, BTreeSet<String>>, start: &str) -> Option<Vec<String>> {
    let mut stack = vec![(start.to_string(), vec![start.to_string()])];
    let mut seen = BTreeSet::new();
    while let Some((module, path)) = stack.pop() {
        for next in graph.get(&module).into_iter().flatten() {
            if next == start {
                let mut cycle = path.clone();
                cycle.push(start.to_string());
                return Some(cycle);
            }
            if seen.insert(next.clone()) {
                let mut longer = path.clone();
                longer.push(next.clone());
                stack.push((next.clone(), longer));
            }
        }
    }
    None
}

#[test]
fn top_level_modules_import_one_another_without_a_cycle() {
    let graph = imports();
    assert!(graph.len() > 10, "the source tree was not found: {graph:?}");
    let cycles: Vec<String> = graph
        .keys()
        .filter_map(|module| cycle_through(&graph, module))
        .map(|cycle| cycle.join(" → "))
        .collect();
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

#[test]
fn shared_modules_import_no_layer() {
    let graph = imports();
    let layers = [
        "ingress",
        "store",
        "session",
        "agent",
        "deliver",
        "lifecycle",
        "reconcile",
        "cli",
    ];
    for shared in [
        "config",
        "signature",
        "sender",
        "logging",
        "secret",
        "template",
        "tls",
        "operator",
        "output",
        "telemetry",
        "clock",
        "locks",
    ] {
        let imported: Vec<&String> = graph
            .get(shared)
            .into_iter()
            .flatten()
            .filter(|name| layers.contains(&name.as_str()))
            .collect();
        assert!(
            imported.is_empty(),
            "{shared} is shared by the layers but imports {imported:?}"
        );
    }
}
