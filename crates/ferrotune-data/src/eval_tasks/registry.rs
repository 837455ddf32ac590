//! The task registry (built-in tasks, `include_path` tasks and groups, tags) and the selection
//! a `tasks` list makes of it (groups, their aggregate metrics).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_yaml_ng::Value as Yaml;

use super::spec::yaml_display;
use super::{list_items, task_err, TaskSpec, BUILTIN_TASKS};
use crate::error::{DataError, Result};

// ---------------------------------------------------------------------------------------------
// Registry: built-in tasks, `include_path` tasks, tags.

/// A task's raw mapping and where it came from.
#[derive(Debug, Clone)]
struct RawTask {
    map: serde_yaml_ng::Mapping,
    origin: String,
    /// The folder a relative `include` is read from (none for built-in tasks).
    dir: Option<PathBuf>,
}

/// The tasks and groups that can be named: built-in ones and those of an `include_path` folder.
#[derive(Debug, Clone)]
pub struct TaskRegistry {
    tasks: BTreeMap<String, RawTask>,
    groups: BTreeMap<String, RawTask>,
}

/// MMLU's 57 subjects and the category group each belongs to (the harness's `mmlu` tasks:
/// `mmlu_<subject>`, grouped into `mmlu_stem`, `mmlu_other`, `mmlu_social_sciences`,
/// `mmlu_humanities`, and those into `mmlu`).
const MMLU_SUBJECTS: &[(&str, &str)] = &[
    ("abstract_algebra", "stem"),
    ("anatomy", "stem"),
    ("astronomy", "stem"),
    ("business_ethics", "other"),
    ("clinical_knowledge", "other"),
    ("college_biology", "stem"),
    ("college_chemistry", "stem"),
    ("college_computer_science", "stem"),
    ("college_mathematics", "stem"),
    ("college_medicine", "other"),
    ("college_physics", "stem"),
    ("computer_security", "stem"),
    ("conceptual_physics", "stem"),
    ("econometrics", "social_sciences"),
    ("electrical_engineering", "stem"),
    ("elementary_mathematics", "stem"),
    ("formal_logic", "humanities"),
    ("global_facts", "other"),
    ("high_school_biology", "stem"),
    ("high_school_chemistry", "stem"),
    ("high_school_computer_science", "stem"),
    ("high_school_european_history", "humanities"),
    ("high_school_geography", "social_sciences"),
    ("high_school_government_and_politics", "social_sciences"),
    ("high_school_macroeconomics", "social_sciences"),
    ("high_school_mathematics", "stem"),
    ("high_school_microeconomics", "social_sciences"),
    ("high_school_physics", "stem"),
    ("high_school_psychology", "social_sciences"),
    ("high_school_statistics", "stem"),
    ("high_school_us_history", "humanities"),
    ("high_school_world_history", "humanities"),
    ("human_aging", "other"),
    ("human_sexuality", "social_sciences"),
    ("international_law", "humanities"),
    ("jurisprudence", "humanities"),
    ("logical_fallacies", "humanities"),
    ("machine_learning", "stem"),
    ("management", "other"),
    ("marketing", "other"),
    ("medical_genetics", "other"),
    ("miscellaneous", "other"),
    ("moral_disputes", "humanities"),
    ("moral_scenarios", "humanities"),
    ("nutrition", "other"),
    ("philosophy", "humanities"),
    ("prehistory", "humanities"),
    ("professional_accounting", "other"),
    ("professional_law", "humanities"),
    ("professional_medicine", "other"),
    ("professional_psychology", "social_sciences"),
    ("public_relations", "social_sciences"),
    ("security_studies", "social_sciences"),
    ("sociology", "social_sciences"),
    ("us_foreign_policy", "social_sciences"),
    ("virology", "other"),
    ("world_religions", "humanities"),
];

impl TaskRegistry {
    /// The built-in tasks and groups, plus every task or group YAML under `include_path`
    /// (searched recursively; a file's task overrides a built-in one of the same name, as the
    /// harness's include path does).
    pub fn new(include_path: Option<&Path>) -> Result<Self> {
        let mut registry = Self {
            tasks: BTreeMap::new(),
            groups: BTreeMap::new(),
        };
        let builtin: Yaml = serde_yaml_ng::from_str(BUILTIN_TASKS)
            .map_err(|e| DataError::Dataset(format!("built-in tasks: invalid YAML: {e}")))?;
        for entry in builtin.as_sequence().into_iter().flatten() {
            let map = entry.as_mapping().cloned().unwrap_or_default();
            registry.add(map, "built-in".into(), None)?;
        }
        for (subject, category) in MMLU_SUBJECTS {
            let text = format!(
                "task: mmlu_{subject}\ntask_alias: {subject}\ninclude: _mmlu_template\n\
                 dataset_name: {subject}\ntag: mmlu_{category}_tasks\n\
                 description: \"The following are multiple choice questions (with answers) about {}.\\n\\n\"\n",
                subject.replace('_', " ")
            );
            let map: serde_yaml_ng::Mapping = serde_yaml_ng::from_str(&text)
                .map_err(|e| DataError::Dataset(format!("built-in task mmlu_{subject}: {e}")))?;
            registry.add(map, "built-in".into(), None)?;
        }
        if let Some(dir) = include_path {
            if !dir.is_dir() {
                return Err(DataError::NotFound {
                    path: dir.to_path_buf(),
                    what: "include_path: a folder of task YAML files",
                });
            }
            let mut files = Vec::new();
            yaml_files(dir, &mut files)?;
            files.sort();
            for file in files {
                let (map, origin) = read_yaml_map(&file)?;
                registry.add(map, origin, file.parent().map(Path::to_path_buf))?;
            }
        }
        Ok(registry)
    }

    /// Registers a task (`task: name`) or a group (`group: name` with a `task` list); a mapping
    /// with neither is a shared piece other files include.
    fn add(
        &mut self,
        map: serde_yaml_ng::Mapping,
        origin: String,
        dir: Option<PathBuf>,
    ) -> Result<()> {
        if let Some(group) = map.get("group") {
            let Some(name) = group.as_str() else {
                return task_err(&origin, "'group' must be a string");
            };
            let origin = if dir.is_none() {
                format!("built-in group {name}")
            } else {
                origin
            };
            self.groups
                .insert(name.to_string(), RawTask { map, origin, dir });
            return Ok(());
        }
        let Some(name) = map.get("task") else {
            return Ok(());
        };
        let Some(name) = name.as_str().map(str::to_string) else {
            return task_err(
                &origin,
                "'task' must be a string (a list of tasks needs 'group')",
            );
        };
        let origin = if dir.is_none() {
            format!("built-in task {name}")
        } else {
            origin
        };
        self.tasks.insert(name, RawTask { map, origin, dir });
        Ok(())
    }

    /// Every task name, sorted.
    pub fn names(&self) -> Vec<String> {
        self.tasks.keys().cloned().collect()
    }

    /// The tasks `name` stands for: a task, a tag (its tasks in name order), or a group (every
    /// task under it).
    pub fn resolve(&self, name: &str) -> Result<Vec<TaskSpec>> {
        Ok(select(self, &[name.to_string()])?.tasks)
    }

    /// The tasks of tag `name`, in name order (empty if it is no tag).
    fn tagged(&self, name: &str) -> Vec<String> {
        self.tasks
            .iter()
            // Tags are inherited through `include` (arc_challenge is ai2_arc through arc_easy).
            .filter(|(_, raw)| {
                self.merged(raw, 0)
                    .is_ok_and(|m| tags_of(&m).iter().any(|t| t == name))
            })
            .map(|(n, _)| n.clone())
            .collect()
    }

    fn unknown(&self, name: &str) -> DataError {
        let mut known: Vec<&str> = self
            .tasks
            .keys()
            .filter(|n| !n.starts_with("mmlu_") && !n.starts_with('_'))
            .map(String::as_str)
            .collect();
        known.extend(self.groups.keys().map(String::as_str));
        known.sort_unstable();
        DataError::Dataset(format!(
            "tasks: unknown task '{name}' (known: {}, mmlu_<subject>; more through include_path)",
            known.join(", ")
        ))
    }

    fn group_spec(&self, name: &str) -> Result<(GroupSpec, Vec<Yaml>)> {
        let raw = &self.groups[name];
        let map = self.merged(raw, 0)?;
        let origin = &raw.origin;
        for key in map.keys() {
            let k = key.as_str().unwrap_or_default();
            if ![
                "group",
                "group_alias",
                "task",
                "aggregate_metric_list",
                "metadata",
            ]
            .contains(&k)
            {
                return task_err(origin, format!("group '{name}': unknown key '{k}'"));
            }
        }
        let children = match map.get("task") {
            Some(Yaml::Sequence(items)) => items.clone(),
            Some(Yaml::String(s)) => vec![Yaml::String(s.clone())],
            _ => {
                return task_err(
                    origin,
                    format!("group '{name}': 'task' must list its tasks"),
                )
            }
        };
        let mut aggregate = Vec::new();
        for item in list_items(map.get("aggregate_metric_list")) {
            let metric = item.get("metric").and_then(|m| m.as_str()).ok_or_else(|| {
                DataError::Dataset(format!(
                    "{origin}: group '{name}': every aggregate_metric_list entry needs a 'metric'"
                ))
            })?;
            if let Some(agg) = item.get("aggregation").and_then(|a| a.as_str()) {
                if agg != "mean" {
                    return task_err(
                        origin,
                        format!("group '{name}': aggregation '{agg}' is not supported (mean)"),
                    );
                }
            }
            aggregate.push(AggregateSpec {
                metric: metric.to_string(),
                weight_by_size: item
                    .get("weight_by_size")
                    .and_then(|w| w.as_bool())
                    .unwrap_or(true),
            });
        }
        let version = map
            .get("metadata")
            .and_then(|m| m.get("version"))
            .map(yaml_display)
            .unwrap_or_else(|| "N/A".into());
        let spec = GroupSpec {
            name: name.to_string(),
            alias: yaml_str(&map, "group_alias"),
            version,
            children: Vec::new(),
            aggregate,
        };
        Ok((spec, children))
    }

    fn spec(&self, name: &str) -> Result<TaskSpec> {
        let raw = &self.tasks[name];
        let merged = self.merged(raw, 0)?;
        TaskSpec::from_mapping(name, &merged, &raw.origin)
    }

    /// `raw` with its `include` chain merged underneath (the including task's keys win).
    fn merged(&self, raw: &RawTask, depth: usize) -> Result<serde_yaml_ng::Mapping> {
        if depth > 16 {
            return task_err(&raw.origin, "'include' nests more than 16 deep (a cycle?)");
        }
        let Some(include) = raw.map.get("include") else {
            return Ok(raw.map.clone());
        };
        let Some(include) = include.as_str() else {
            return task_err(&raw.origin, "'include' must be a string");
        };
        let base = if include.ends_with(".yaml") || include.ends_with(".yml") {
            let path = match &raw.dir {
                Some(dir) => dir.join(include),
                None => PathBuf::from(include),
            };
            let (map, origin) = read_yaml_map(&path)?;
            RawTask {
                map,
                origin,
                dir: path.parent().map(Path::to_path_buf),
            }
        } else if let Some(t) = self.tasks.get(include) {
            t.clone()
        } else {
            return task_err(
                &raw.origin,
                format!("'include: {include}' is neither a YAML file nor a known task"),
            );
        };
        let mut merged = self.merged(&base, depth + 1)?;
        for (k, v) in &raw.map {
            if k.as_str() != Some("include") {
                merged.insert(k.clone(), v.clone());
            }
        }
        merged.remove("include");
        Ok(merged)
    }
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|source| DataError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            yaml_files(&path, out)?;
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        ) {
            out.push(path);
        }
    }
    Ok(())
}

fn read_yaml_map(path: &Path) -> Result<(serde_yaml_ng::Mapping, String)> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let value: Yaml = serde_yaml_ng::from_str(&text)
        .map_err(|e| DataError::Dataset(format!("{origin}: invalid YAML: {e}")))?;
    match value {
        Yaml::Mapping(m) => Ok((m, origin)),
        _ => task_err(&origin, "a task file must be a mapping of keys"),
    }
}

fn yaml_str(map: &serde_yaml_ng::Mapping, key: &str) -> Option<String> {
    map.get(key).and_then(|v| v.as_str()).map(str::to_string)
}

fn tags_of(map: &serde_yaml_ng::Mapping) -> Vec<String> {
    match map.get("tag") {
        Some(Yaml::String(s)) => vec![s.clone()],
        Some(Yaml::Sequence(items)) => items
            .iter()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect(),
        _ => Vec::new(),
    }
}

/// A group of tasks (`group:` with a `task:` list), whose metrics aggregate its tasks'.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupSpec {
    /// The group's name.
    pub name: String,
    /// `group_alias`: the name the table shows.
    pub alias: Option<String>,
    /// `metadata.version`.
    pub version: String,
    /// Its direct members: task and group names (a tag in the list stands for its tasks).
    pub children: Vec<String>,
    /// `aggregate_metric_list`; empty: the group only arranges the table.
    pub aggregate: Vec<AggregateSpec>,
}

/// One metric a group aggregates over its tasks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AggregateSpec {
    /// The tasks' metric.
    pub metric: String,
    /// Weight each task by its document count (default), else each task counts once.
    pub weight_by_size: bool,
}

/// What a `tasks` list selects: every task to run (once each, in order) and every group met.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// The tasks to run.
    pub tasks: Vec<TaskSpec>,
    /// The groups, each with its direct members.
    pub groups: Vec<GroupSpec>,
}

impl Selection {
    /// The tasks under group `name`, at any depth.
    pub fn leaves(&self, name: &str) -> Vec<String> {
        let mut out = Vec::new();
        self.collect_leaves(name, &mut out, 0);
        out
    }

    fn collect_leaves(&self, name: &str, out: &mut Vec<String>, depth: usize) {
        match self.groups.iter().find(|g| g.name == name) {
            Some(g) if depth < 32 => {
                for c in &g.children {
                    self.collect_leaves(c, out, depth + 1);
                }
            }
            Some(_) => {}
            None => {
                if !out.iter().any(|o| o == name) {
                    out.push(name.to_string());
                }
            }
        }
    }
}

/// The tasks and groups `names` select (tasks, tags, groups), checked.
pub fn select(registry: &TaskRegistry, names: &[String]) -> Result<Selection> {
    let mut sel = Selection::default();
    let mut seen = BTreeSet::new();
    for name in names {
        add_selected(registry, name, &mut sel, &mut seen, 0)?;
    }
    Ok(sel)
}

/// Adds `name` to the selection; returns the names it stands for among a group's members.
fn add_selected(
    registry: &TaskRegistry,
    name: &str,
    sel: &mut Selection,
    seen: &mut BTreeSet<String>,
    depth: usize,
) -> Result<Vec<String>> {
    if depth > 16 {
        return Err(DataError::Dataset(format!(
            "group '{name}': groups nest more than 16 deep (a cycle?)"
        )));
    }
    if registry.groups.contains_key(name) {
        if seen.insert(format!("group {name}")) {
            let (mut spec, children) = registry.group_spec(name)?;
            for child in children {
                let Some(c) = child.as_str() else {
                    return task_err(
                        &registry.groups[name].origin,
                        format!(
                            "group '{name}': list task names; a task defined inside a group is not \
                             supported (give it its own file)"
                        ),
                    );
                };
                let members = add_selected(registry, c, sel, seen, depth + 1)?;
                spec.children.extend(members);
            }
            sel.groups.push(spec);
        }
        return Ok(vec![name.to_string()]);
    }
    if registry.tasks.contains_key(name) {
        if seen.insert(format!("task {name}")) {
            sel.tasks.push(registry.spec(name)?);
        }
        return Ok(vec![name.to_string()]);
    }
    let tagged = registry.tagged(name);
    if tagged.is_empty() {
        return Err(registry.unknown(name));
    }
    for t in &tagged {
        add_selected(registry, t, sel, seen, depth + 1)?;
    }
    Ok(tagged)
}

/// The tasks `names` select, in order, without repeats.
pub fn resolve_tasks(registry: &TaskRegistry, names: &[String]) -> Result<Vec<TaskSpec>> {
    Ok(select(registry, names)?.tasks)
}
