//! `spec.demand` as the operator keeps it: a map from model name to the
//! time of its last request, stored as a sorted vector. The operator caches
//! every residency, and a B-tree's first node alone is about 540 bytes even
//! for one key (measured by `cargo bench --bench heap`); on the wire it is
//! an ordinary JSON object.

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::BTreeMap;

/// Model name -> RFC 3339 time of its last request, sorted by model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DemandMap(Vec<(String, String)>);

impl DemandMap {
    fn find(&self, model: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(m, _)| m.as_str().cmp(model))
    }

    pub fn get(&self, model: &str) -> Option<&String> {
        self.find(model).ok().map(|i| &self.0[i].1)
    }

    pub fn contains_key(&self, model: &str) -> bool {
        self.find(model).is_ok()
    }

    /// Sets `model`'s time; returns the one it replaces.
    pub fn insert(&mut self, model: String, at: String) -> Option<String> {
        match self.find(&model) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, at)),
            Err(i) => {
                self.0.insert(i, (model, at));
                None
            }
        }
    }

    pub fn remove(&mut self, model: &str) -> Option<String> {
        self.find(model).ok().map(|i| self.0.remove(i).1)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// (model, time) pairs, by model.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &String)> {
        self.0.iter().map(|(m, t)| (m, t))
    }

    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.0.iter().map(|(m, _)| m)
    }
}

impl<'a> IntoIterator for &'a DemandMap {
    type Item = (&'a String, &'a String);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (String, String)>,
        fn(&'a (String, String)) -> (&'a String, &'a String),
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(m, t)| (m, t))
    }
}

impl FromIterator<(String, String)> for DemandMap {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(pairs: I) -> Self {
        // Through a B-tree: sorted, and a later duplicate wins, as in JSON.
        let sorted: BTreeMap<String, String> = pairs.into_iter().collect();
        DemandMap(sorted.into_iter().collect())
    }
}

impl From<BTreeMap<String, String>> for DemandMap {
    fn from(map: BTreeMap<String, String>) -> Self {
        DemandMap(map.into_iter().collect())
    }
}

impl PartialEq<BTreeMap<String, String>> for DemandMap {
    fn eq(&self, other: &BTreeMap<String, String>) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl std::ops::Index<&str> for DemandMap {
    type Output = String;

    fn index(&self, model: &str) -> &String {
        self.get(model)
            .unwrap_or_else(|| panic!("no demand for {model:?}"))
    }
}

impl Serialize for DemandMap {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

impl<'de> Deserialize<'de> for DemandMap {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        BTreeMap::<String, String>::deserialize(d).map(DemandMap::from)
    }
}

impl JsonSchema for DemandMap {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "DemandMap".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        // Keys are model names: a schema cannot say so, a CEL rule can.
        // A key that names no registry model is still admitted (an
        // autoscaler may write it before the registry edit lands) and
        // refused in status as UnknownModel.
        let mut schema = json_schema!({
            "type": "object",
            "additionalProperties": {"type": "string", "format": "date-time", "maxLength": 64},
            "maxProperties": 100000,
        });
        schema.insert(
            "x-kubernetes-validations".into(),
            super::rules::demand_keys(),
        );
        schema
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn behaves_as_a_sorted_map_and_reads_and_writes_a_json_object() {
        let mut d = DemandMap::default();
        assert_eq!(d.insert("b".into(), "1".into()), None);
        assert_eq!(d.insert("a".into(), "2".into()), None);
        assert_eq!(d.insert("b".into(), "3".into()), Some("1".into()));
        assert_eq!(d.keys().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(d["b"], "3");
        assert!(d.contains_key("a") && !d.contains_key("c"));
        let json = serde_json::to_string(&d).unwrap();
        assert_eq!(json, r#"{"a":"2","b":"3"}"#);
        let back: DemandMap = serde_json::from_str(r#"{"b":"3","a":"2"}"#).unwrap();
        assert_eq!(back, d);
        assert_eq!(d.remove("a"), Some("2".into()));
        assert_eq!(d.len(), 1);
    }
}
