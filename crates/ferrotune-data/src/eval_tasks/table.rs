//! The harness's Markdown results table.

use std::collections::{BTreeMap, BTreeSet};

use super::metrics::Outcome;
use super::registry::{GroupSpec, Selection};
use super::{MetricResult, TaskSpec};

/// The harness's results table (`lm_eval.utils.make_table`, a pytablewriter Markdown table, as
/// torchtune's recipe prints it): groups first as a tree (members indented `" - "`, in name
/// order), then the other tasks in name order; one row per metric in name order; numeric
/// columns right-aligned.
pub fn results_table(
    sel: &Selection,
    tasks: &BTreeMap<String, Outcome>,
    groups: &BTreeMap<String, Outcome>,
) -> String {
    // (display name, version, n-shot, metrics, a top-level group) in the harness's order.
    let mut entries: Vec<Entry> = Vec::new();
    let children: BTreeSet<&str> = sel
        .groups
        .iter()
        .flat_map(|g| g.children.iter().map(String::as_str))
        .collect();
    let mut placed: BTreeSet<String> = BTreeSet::new();
    let mut roots: Vec<&GroupSpec> = sel
        .groups
        .iter()
        .filter(|g| !children.contains(g.name.as_str()))
        .collect();
    roots.sort_by(|a, b| a.name.cmp(&b.name));
    let ctx = TableCtx { sel, tasks, groups };
    for g in roots {
        ctx.visit(&g.name, 0, &mut placed, &mut entries);
    }
    let mut rest: Vec<&TaskSpec> = sel
        .tasks
        .iter()
        .filter(|t| !placed.contains(&t.name))
        .collect();
    rest.sort_by(|a, b| a.name.cmp(&b.name));
    for t in rest {
        ctx.visit(&t.name, 0, &mut placed, &mut entries);
    }

    let headers = [
        "Tasks", "Version", "Filter", "n-shot", "Metric", "", "Value", "", "Stderr",
    ];
    let mut rows: Vec<[String; 9]> = Vec::new();
    for e in entries {
        let mut sorted: Vec<&MetricResult> = e.outcome.metrics.iter().collect();
        // The harness sorts its `metric,filter` keys.
        sorted.sort_by_key(|m| format!("{},{}", m.name, m.filter));
        for (i, m) in sorted.iter().enumerate() {
            let first = i == 0;
            // The harness leaves a top-level group's direction and shot count blank.
            let arrow = match (e.root_group, m.higher_is_better) {
                (true, _) => "",
                (false, true) => "↑",
                (false, false) => "↓",
            };
            rows.push([
                if first {
                    e.shown.clone()
                } else {
                    String::new()
                },
                if first {
                    e.version.clone()
                } else {
                    String::new()
                },
                m.filter.clone(),
                e.shots.clone(),
                m.name.clone(),
                arrow.into(),
                format!("{:.4}", m.value),
                "±".into(),
                m.stderr.map_or("   N/A".into(), |s| format!("{s:.4}")),
            ]);
        }
    }
    markdown_table(&headers, &rows)
}

struct Entry<'a> {
    shown: String,
    version: String,
    shots: String,
    outcome: &'a Outcome,
    root_group: bool,
}

struct TableCtx<'a> {
    sel: &'a Selection,
    tasks: &'a BTreeMap<String, Outcome>,
    groups: &'a BTreeMap<String, Outcome>,
}

impl<'a> TableCtx<'a> {
    /// The harness's tree walk: a group's row, then its members in name order, indented.
    fn visit(
        &self,
        name: &str,
        depth: usize,
        placed: &mut BTreeSet<String>,
        entries: &mut Vec<Entry<'a>>,
    ) {
        if depth > 32 {
            return;
        }
        placed.insert(name.to_string());
        let indent = |shown: &str| {
            if depth == 0 {
                shown.to_string()
            } else {
                format!("{}- {shown}", " ".repeat(depth))
            }
        };
        if let Some(g) = self.sel.groups.iter().find(|g| g.name == name) {
            if let Some(o) = self.groups.get(name).filter(|o| !o.metrics.is_empty()) {
                let shown = g.alias.as_deref().unwrap_or(&g.name);
                entries.push(Entry {
                    shown: indent(shown),
                    version: table_number(&g.version),
                    shots: if depth == 0 { " ".into() } else { "0".into() },
                    outcome: o,
                    root_group: depth == 0,
                });
            }
            let mut kids: Vec<&String> = g.children.iter().collect();
            kids.sort();
            kids.dedup();
            for c in kids {
                self.visit(c, depth + 1, placed, entries);
            }
        } else if let (Some(t), Some(o)) = (
            self.sel.tasks.iter().find(|t| t.name == name),
            self.tasks.get(name),
        ) {
            let shown = t.alias.as_deref().unwrap_or(&t.name);
            entries.push(Entry {
                shown: indent(shown),
                version: table_number(&t.version),
                shots: t.num_fewshot.to_string(),
                outcome: o,
                root_group: false,
            });
        }
    }
}

/// Decimal places of a number as written, trailing zeros dropped (`"0.2500"` → 2); `None` for
/// text that is not a number.
fn written_places(cell: &str) -> Option<usize> {
    let t = cell.trim();
    t.parse::<f64>().ok()?;
    Some(match t.split_once('.') {
        Some((_, frac)) => frac.trim_end_matches('0').len(),
        None => 0,
    })
}

/// A Markdown table as pytablewriter writes one: headers centred; a column of numbers is
/// right-aligned with as many decimals as its most precise cell; in a column mixing numbers and
/// text, whole numbers lose their decimals, other numbers keep the column's, and numbers
/// right-align while text left-aligns.
fn markdown_table(headers: &[&str; 9], rows: &[[String; 9]]) -> String {
    let mut cells: Vec<[String; 9]> = rows.to_vec();
    let mut numeric_column = [false; 9];
    let mut right = vec![[false; 9]; rows.len()];
    for c in 0..9 {
        let filled: Vec<usize> = (0..rows.len())
            .filter(|&r| !rows[r][c].trim().is_empty())
            .collect();
        let places: Vec<Option<usize>> = filled
            .iter()
            .map(|&r| written_places(&rows[r][c]))
            .collect();
        let all_numbers = !filled.is_empty() && places.iter().all(Option::is_some);
        numeric_column[c] = all_numbers;
        let most = places.iter().flatten().copied().max().unwrap_or(0);
        for (&r, p) in filled.iter().zip(&places) {
            let Some(p) = p else { continue };
            let v: f64 = rows[r][c].trim().parse().unwrap_or(0.0);
            let shown_places = if all_numbers || *p > 0 { most } else { 0 };
            cells[r][c] = format!("{v:.shown_places$}");
            right[r][c] = true;
        }
    }
    let widths: Vec<usize> = (0..9)
        .map(|c| {
            cells
                .iter()
                .map(|r| r[c].chars().count())
                .chain([headers[c].chars().count(), 3])
                .max()
                .unwrap_or(3)
        })
        .collect();
    let mut out = String::new();
    let header: Vec<String> = (0..9).map(|c| py_center(headers[c], widths[c])).collect();
    out.push_str(&format!("|{}|\n", header.join("|")));
    let rule: Vec<String> = (0..9)
        .map(|c| {
            if numeric_column[c] {
                format!("{}:", "-".repeat(widths[c] - 1))
            } else {
                "-".repeat(widths[c])
            }
        })
        .collect();
    out.push_str(&format!("|{}|\n", rule.join("|")));
    for (r, row) in cells.iter().enumerate() {
        let line: Vec<String> = (0..9)
            .map(|c| {
                let pad = " ".repeat(widths[c] - row[c].chars().count());
                if right[r][c] {
                    format!("{pad}{}", row[c])
                } else {
                    format!("{}{pad}", row[c])
                }
            })
            .collect();
        out.push_str(&format!("|{}|\n", line.join("|")));
    }
    out
}

/// A version as pytablewriter prints it: `2.0` as `2`.
fn table_number(text: &str) -> String {
    match text.parse::<f64>() {
        Ok(f) if f.fract() == 0.0 && f.abs() < 1e15 => format!("{}", f as i64),
        _ => text.to_string(),
    }
}

/// A header centred as pytablewriter centres it (an odd space goes to the right).
fn py_center(s: &str, width: usize) -> String {
    let len = s.chars().count();
    if len >= width {
        return s.to_string();
    }
    let left = (width - len) / 2;
    format!("{}{s}{}", " ".repeat(left), " ".repeat(width - len - left))
}
