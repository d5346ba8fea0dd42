//! What a ResidencySet's CEL selector may cost before the operator runs it.
//! A tenant's selector runs inside the operator, which serves every tenant:
//! a selector nested 500 deep overflowed the stack of the runtime's thread
//! (an abort no `catch_unwind` can catch, at every start), and nine nested
//! comprehensions over ten elements (10^9 steps a device) pinned a core for
//! good. So each selector is held to three bounds, all checked before it
//! runs on any device: how deep its brackets and conditionals nest in the
//! text (the parser recurses on them), how deep its syntax tree is (the
//! evaluator recurses on it), and an estimate of its steps on one device
//! (a comprehension costs its body times the size of what it ranges over).
//! Parsing and running happen on a thread of their own with a large stack
//! ([`crate::residency::devices::select`]), never on the async runtime.
//! Kubernetes bounds the same CEL in a ResourceClaim by a cost limit; these
//! bounds are tighter because the operator runs a set's selectors over every
//! published device, where the scheduler runs a claim's over one node's.

use cel_interpreter::IdedExpr;
use cel_parser::ast::{EntryExpr, Expr};

/// Brackets (`(`, `[`, `{`) and conditionals (`?`) nested in a selector's
/// text, at most.
pub const MAX_NESTING: usize = 32;
/// The depth of a selector's syntax tree, at most (`a && b && ...` chains
/// and `!!!x` runs nest without brackets).
pub const MAX_DEPTH: usize = 100;
/// The estimated steps of all of a set's selectors on one device, at most.
/// A plain comparison of an attribute costs about 5; the DeviceClass's
/// selectors count too.
pub const MAX_COST: u64 = 10_000;
/// What a comprehension over something other than a literal is taken to
/// range over: a device has at most 32 attributes and capacities (the DRA
/// API's limit), and selectors see nothing larger.
const UNKNOWN_SIZE: u64 = 32;

/// The text's nesting of brackets and conditionals outside string
/// literals, and the position where it first passes `MAX_NESTING`.
pub fn check_nesting(text: &str) -> Result<(), String> {
    let mut depth = 0usize;
    let mut conditionals = 0usize;
    let mut quote: Option<(char, bool)> = None;
    let mut chars = text.chars().peekable();
    let mut previous = ' ';
    while let Some(c) = chars.next() {
        match quote {
            Some((q, raw)) => {
                if c == '\\' && !raw {
                    chars.next();
                } else if c == q {
                    quote = None;
                }
            }
            None => match c {
                '\'' | '"' => quote = Some((c, matches!(previous, 'r' | 'R'))),
                '(' | '[' | '{' => depth += 1,
                ')' | ']' | '}' => depth = depth.saturating_sub(1),
                '?' => conditionals += 1,
                _ => {}
            },
        }
        if depth + conditionals > MAX_NESTING {
            return Err(format!(
                "nests brackets and conditionals more than {MAX_NESTING} deep"
            ));
        }
        previous = c;
    }
    Ok(())
}

/// The syntax tree's children.
fn children(e: &IdedExpr) -> Vec<&IdedExpr> {
    match &e.expr {
        Expr::Call(c) => c.target.iter().map(|t| &**t).chain(&c.args).collect(),
        Expr::Comprehension(c) => vec![
            &*c.iter_range,
            &*c.accu_init,
            &*c.loop_cond,
            &*c.loop_step,
            &*c.result,
        ],
        Expr::List(l) => l.elements.iter().collect(),
        Expr::Map(m) => entries(&m.entries),
        Expr::Struct(s) => entries(&s.entries),
        Expr::Select(s) => vec![&*s.operand],
        Expr::Ident(_) | Expr::Literal(_) | Expr::Unspecified => Vec::new(),
    }
}

fn entries(entries: &[cel_parser::ast::IdedEntryExpr]) -> Vec<&IdedExpr> {
    entries
        .iter()
        .flat_map(|e| match &e.expr {
            EntryExpr::StructField(f) => vec![&f.value],
            EntryExpr::MapEntry(m) => vec![&m.key, &m.value],
        })
        .collect()
}

/// The tree's depth, found without recursion (the tree is unchecked yet).
pub fn depth(e: &IdedExpr) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(e, 1)];
    while let Some((e, d)) = stack.pop() {
        deepest = deepest.max(d);
        stack.extend(children(e).into_iter().map(|c| (c, d + 1)));
    }
    deepest
}

/// How many elements `e` may hold when a comprehension ranges over it.
fn size(e: &IdedExpr) -> u64 {
    match &e.expr {
        Expr::List(l) => l.elements.len() as u64,
        Expr::Map(m) => m.entries.len() as u64,
        // map() and filter() keep at most what they range over.
        Expr::Comprehension(c) => size(&c.iter_range),
        Expr::Call(c) if c.func_name == "_+_" => c.args.iter().map(size).sum(),
        _ => UNKNOWN_SIZE,
    }
}

/// The estimated steps of `e` on one device: one a node, a comprehension's
/// condition and step once per element of its range. Saturates. Called
/// only on a tree whose depth is checked.
pub fn cost(e: &IdedExpr) -> u64 {
    match &e.expr {
        Expr::Comprehension(c) => {
            let per_element = cost(&c.loop_cond).saturating_add(cost(&c.loop_step));
            1u64.saturating_add(cost(&c.iter_range))
                .saturating_add(cost(&c.accu_init))
                .saturating_add(size(&c.iter_range).saturating_mul(per_element))
                .saturating_add(cost(&c.result))
        }
        _ => children(e)
            .into_iter()
            .fold(1u64, |sum, c| sum.saturating_add(cost(c))),
    }
}

/// The verdicts of the selectors checked lately, by their text: a set is
/// reconciled again on every slice, node or class change, and a thousand
/// hostile selectors took 3.25 CPU seconds to check once
/// (`cargo bench --bench hostile`). Emptied when it holds
/// [`REMEMBERED`] of them.
static VERDICTS: std::sync::LazyLock<
    std::sync::Mutex<std::collections::HashMap<String, Result<u64, String>>>,
> = std::sync::LazyLock::new(Default::default);

/// How many verdicts are remembered at most.
const REMEMBERED: usize = 4096;

/// Checks one selector against the bounds; its estimated cost when it
/// passes. The text is checked before it is parsed; a verdict is
/// remembered ([`VERDICTS`]).
pub fn check(text: &str) -> Result<u64, String> {
    if let Some(v) = VERDICTS.lock().expect("verdicts lock").get(text) {
        return v.clone();
    }
    let verdict = check_now(text);
    let mut verdicts = VERDICTS.lock().expect("verdicts lock");
    if verdicts.len() >= REMEMBERED {
        verdicts.clear();
    }
    verdicts.insert(text.to_owned(), verdict.clone());
    verdict
}

fn check_now(text: &str) -> Result<u64, String> {
    check_nesting(text).map_err(|why| format!("{text:?} {why}"))?;
    let parsed = std::panic::catch_unwind(|| cel_parser::Parser::default().parse(text))
        .map_err(|_| format!("{text:?} is not a CEL expression"))?
        .map_err(|e| format!("{text:?} is not a CEL expression: {e}"))?;
    let d = depth(&parsed);
    if d > MAX_DEPTH {
        return Err(format!(
            "{text:?} is {d} deep; a selector is at most {MAX_DEPTH} deep"
        ));
    }
    Ok(cost(&parsed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinary_selectors_pass_and_cost_little() {
        for s in [
            "device.attributes['gpu.nvidia.com'].productName == 'H100'",
            "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
            "device.attributes['gpu.nvidia.com'].index in [0, 1, 2, 3]",
            "device.attributes['gpu.nvidia.com'].all(k, k != 'mig')",
            "'((((' + \")))\" == r'[[[[' || true",
        ] {
            let c = check(s).unwrap_or_else(|e| panic!("{s}: {e}"));
            assert!(c < 500, "{s}: {c}");
        }
    }

    /// The black-box round's shapes: each one is refused, none crashes
    /// (on the thread selectors run on; a test thread's 2 MiB would not
    /// parse them).
    #[test]
    fn hostile_selectors_are_refused_before_they_run() {
        crate::residency::devices::on_selector_thread(hostile_shapes);
    }

    fn hostile_shapes() {
        let parens = format!("{}true{}", "(".repeat(500), ")".repeat(500));
        let sizes = format!("{}[1]{}", "size(".repeat(300), ")".repeat(300));
        let lists = format!("{}1{} != []", "[".repeat(400), "]".repeat(400));
        let ternaries = format!("{}1", "true ? 1 : ".repeat(1000));
        let sums = format!("1{} > 0", " + 1".repeat(2000));
        let members = format!("device{}", ".a".repeat(4000));
        let mut nested = "true".to_owned();
        for i in 0..9 {
            nested = format!("[0,1,2,3,4,5,6,7,8,9].all(v{i}, {nested})");
        }
        for (what, s) in [
            ("parens", &parens),
            ("sizes", &sizes),
            ("lists", &lists),
            ("ternaries", &ternaries),
            ("sums", &sums),
            ("members", &members),
        ] {
            let e = check(s).expect_err(what);
            assert!(e.contains("deep"), "{what}: {e}");
        }
        // `&&` chains are balanced as they parse, and a run of `!` folds
        // (depth 2): nothing to bound there.
        assert!(check(&format!("true{}", " && true".repeat(1200))).is_ok());
        assert!(check(&format!("{}true", "!".repeat(5000))).is_ok());
        let cost = check(&nested).expect("nested comprehensions parse");
        assert!(cost > MAX_COST * 1000, "10^9 steps estimated: {cost}");
    }

    #[test]
    fn brackets_in_strings_do_not_nest() {
        let s = format!("'{}' == \"{}\"", "(".repeat(100), "\\\"[".repeat(100));
        assert!(check_nesting(&s).is_ok());
        assert!(check_nesting(&"(".repeat(MAX_NESTING + 1)).is_err());
    }
}
