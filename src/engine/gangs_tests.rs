use super::*;
use crate::engine::Sleep;
use proptest::prelude::*;

const GIB: Bytes = 1 << 30;

/// `n` GPUs of `budget` GiB, each registering `models` (name, GiB).
fn node(n: usize, budget: u64, models: &[(&str, u64)], gangs: &[(&str, usize)]) -> NodeGpus {
    let mut e = Engine::new(budget * GIB);
    for (name, size) in models {
        e.register(name, size * GIB, false).unwrap();
    }
    NodeGpus::new(vec![e; n], gangs.iter().map(|(g, w)| (g.to_string(), *w)))
}

fn residents(n: &NodeGpus) -> Vec<Vec<String>> {
    n.gpus()
        .iter()
        .map(|e| {
            let mut r: Vec<String> = e
                .residents()
                .iter()
                .map(|&id| e.name(id).to_owned())
                .collect();
            r.sort();
            r
        })
        .collect()
}

#[test]
fn a_gang_loads_on_the_gpus_with_room_and_evicts_as_one() {
    // Four GPUs of 24 GiB: a TP-2 model of 16 GiB per GPU, singles of 16.
    let mut n = node(
        4,
        24,
        &[("tp2", 16), ("a", 16), ("b", 16), ("c", 16), ("d", 16)],
        &[("tp2", 2)],
    );
    assert!(matches!(n.request(0, "a"), NodeAdmission::Loaded { .. }));
    assert!(matches!(n.request(1, "b"), NodeAdmission::Loaded { .. }));
    // GPUs 2 and 3 are free: no eviction.
    assert_eq!(
        n.request(0, "tp2"),
        NodeAdmission::Loaded {
            gpus: vec![2, 3],
            evicted: vec![]
        }
    );
    assert_eq!(n.members("tp2"), [2, 3]);
    // A single on GPU 2 evicts the gang there: it leaves GPU 3 too.
    let NodeAdmission::Loaded { evicted, .. } = n.request(2, "c") else {
        panic!("c loads");
    };
    assert_eq!(evicted, [(2, "tp2".to_owned()), (3, "tp2".to_owned())]);
    assert!(n.members("tp2").is_empty());
    assert_eq!(residents(&n), [vec!["a"], vec!["b"], vec!["c"], vec![]]);
    // Back: GPU 3 is free, and of 0..2 the one used longest ago (a on 0)
    // is evicted.
    let NodeAdmission::Loaded { gpus, evicted } = n.request(0, "tp2") else {
        panic!("tp2 loads");
    };
    assert_eq!(gpus, [0, 3]);
    assert_eq!(evicted, [(0, "a".to_owned())]);
    // Counted once: a, b, tp2, c, tp2 loads; a and the gang evictions.
    let c = n.counters();
    assert_eq!((c.loads, c.evictions), (5, 2), "{c:?}");
    // A hit touches both members once.
    assert_eq!(n.request(0, "tp2"), NodeAdmission::Hit { gpus: vec![0, 3] });
    assert_eq!(n.counters().hits, 1);
}

#[test]
fn a_gang_no_gpus_could_hold_is_refused_with_each_gpus_reason() {
    // Three GPUs; one too small, one with a pinned model in the way.
    let mut big = Engine::new(24 * GIB);
    big.register("tp3", 16 * GIB, false).unwrap();
    big.register("pin", 12 * GIB, true).unwrap();
    let mut small = big.clone();
    small.set_budget(8 * GIB);
    let mut pinned = big.clone();
    let pin = pinned.id("pin").unwrap();
    pinned.request(pin);
    let mut n = NodeGpus::new(vec![big, small, pinned], [("tp3".to_owned(), 3)]);
    let NodeAdmission::GangRefused(r) = n.request(0, "tp3") else {
        panic!("refused");
    };
    assert_eq!((r.width, r.could), (3, 1));
    assert_eq!(r.why[0].0, 1);
    assert_eq!(r.why[0].1.as_str(), "LargerThanBudget");
    assert_eq!(r.why[1].0, 2);
    assert_eq!(r.why[1].1.as_str(), "NoEvictableRoom");
    let text = r.to_string();
    assert!(
        text.contains("needs 3 GPUs of one node at once and 1 could ever hold it"),
        "{text}"
    );
    assert!(text.contains("GPU 1: LargerThanBudget"), "{text}");
    assert_eq!(n.counters().refusals, 1);
    // Wider than the node.
    let mut two = node(2, 24, &[("tp4", 8)], &[("tp4", 4)]);
    let NodeAdmission::GangRefused(r) = two.request(0, "tp4") else {
        panic!("refused");
    };
    assert_eq!((r.width, r.could), (4, 2));
}

#[test]
fn no_gpu_evicts_for_a_gang_that_cannot_be_placed_on_the_others() {
    let mut n = node(2, 24, &[("tp2", 16), ("a", 16), ("b", 16)], &[("tp2", 2)]);
    n.request(0, "a");
    n.request(1, "b");
    // b is still loading: GPU 1 cannot make room now, so GPU 0 keeps a.
    n.set_loading("b", true);
    assert_eq!(n.request(0, "tp2"), NodeAdmission::Queued);
    assert_eq!(residents(&n), [vec!["a"], vec!["b"]]);
    assert_eq!(n.counters().evictions, 0);
    n.set_loading("b", false);
    assert!(matches!(n.request(0, "tp2"), NodeAdmission::Loaded { .. }));
    assert_eq!(residents(&n), [vec!["tp2"], vec!["tp2"]]);
}

#[test]
fn a_gang_sleeps_and_wakes_as_one() {
    let mut e = Engine::new(24 * GIB);
    e.set_host_budget(64 * GIB);
    for (m, s) in [("tp2", 16), ("a", 16), ("b", 16)] {
        e.register(m, s * GIB, false).unwrap();
    }
    let tp2 = e.id("tp2").unwrap();
    e.set_sleep(
        tp2,
        Some(Sleep {
            sleeping_size: 2 * GIB,
            host_memory: 16 * GIB,
        }),
    )
    .unwrap();
    let mut n = NodeGpus::new(vec![e; 2], [("tp2".to_owned(), 2)]);
    n.request(0, "tp2");
    // A single on GPU 0 puts the gang to sleep there: it sleeps on 1 too.
    n.request(0, "a");
    for g in n.gpus() {
        assert!(g.is_asleep(tp2), "asleep on every member");
        assert_eq!(
            g.used(),
            if g.is_resident(g.id("a").unwrap()) {
                18
            } else {
                2
            } * GIB
        );
    }
    assert_eq!(n.counters().sleeps, 1);
    // Woken as one, on its members.
    let NodeAdmission::Woken { gpus, evicted } = n.request(1, "tp2") else {
        panic!("woken");
    };
    assert_eq!(gpus, [0, 1]);
    assert_eq!(evicted, [(0, "a".to_owned())]);
    assert_eq!(n.counters().wakes, 1);
    // Retired as one.
    assert!(n.retire(0, "tp2"));
    assert!(n.gpus().iter().all(|g| g.is_asleep(tp2)));
    assert!(n.unload("tp2"));
    assert!(n.gpus().iter().all(|g| !g.is_resident(tp2)));
    assert_eq!(n.counters().unloads, 1);
}

#[test]
fn a_budget_shrink_on_one_member_evicts_the_gang_from_all() {
    let mut n = node(3, 24, &[("tp2", 16), ("a", 4)], &[("tp2", 2)]);
    n.request(0, "tp2");
    let members = n.members("tp2");
    let out = n.set_budget(members[1], 8 * GIB);
    assert_eq!(out.len(), 2, "{out:?}");
    assert!(n.members("tp2").is_empty());
    assert!(n.gpus().iter().all(|g| g.used() == 0));
}

#[derive(Clone, Debug)]
enum Op {
    Request(usize, usize),
    Unload(usize),
    Retire(usize, usize),
    Budget(usize, u64),
    Loading(usize, bool),
}

const MODELS: [(&str, u64); 7] = [
    ("s0", 4),
    ("s1", 6),
    ("s2", 8),
    ("s3", 10),
    ("g2", 8),
    ("g3", 6),
    ("g2b", 12),
];

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        6 => (0..4usize, 0..MODELS.len()).prop_map(|(g, m)| Op::Request(g, m)),
        1 => (0..MODELS.len()).prop_map(Op::Unload),
        1 => (0..4usize, 0..MODELS.len()).prop_map(|(g, m)| Op::Retire(g, m)),
        1 => (0..4usize, 8..28u64).prop_map(|(g, b)| Op::Budget(g, b)),
        1 => (0..MODELS.len(), any::<bool>()).prop_map(|(m, l)| Op::Loading(m, l)),
    ];
    proptest::collection::vec(op, 1..80)
}

fn property_node() -> NodeGpus {
    let mut e = Engine::new(24 * GIB);
    e.set_host_budget(20 * GIB);
    for (m, s) in MODELS {
        let id = e.register(m, s * GIB, false).unwrap();
        if m == "g2" || m == "s1" {
            e.set_sleep(
                id,
                Some(Sleep {
                    sleeping_size: GIB,
                    host_memory: s * GIB,
                }),
            )
            .unwrap();
        }
    }
    NodeGpus::new(
        vec![e; 4],
        [
            ("g2".to_owned(), 2),
            ("g3".to_owned(), 3),
            ("g2b".to_owned(), 2),
        ],
    )
}

/// What must hold after every step: every GPU within its budget, and each
/// gang resident on its width of GPUs (all asleep or all awake) or none.
fn check(n: &NodeGpus) -> Result<(), TestCaseError> {
    for (g, e) in n.gpus().iter().enumerate() {
        prop_assert!(
            e.used() <= e.budget(),
            "GPU {g}: {} > {}",
            e.used(),
            e.budget()
        );
    }
    for (gang, width) in [("g2", 2), ("g3", 3), ("g2b", 2)] {
        let members = n.members(gang);
        let holding: Vec<usize> = (0..4)
            .filter(|&g| n.gpus()[g].is_resident(n.gpus()[g].id(gang).unwrap()))
            .collect();
        prop_assert_eq!(&holding, &members, "{} held where recorded", gang);
        prop_assert!(
            members.is_empty() || members.len() == width,
            "{gang}: {members:?}"
        );
        let asleep: Vec<bool> = members
            .iter()
            .map(|&g| n.gpus()[g].is_asleep(n.gpus()[g].id(gang).unwrap()))
            .collect();
        prop_assert!(
            asleep.windows(2).all(|w| w[0] == w[1]),
            "{gang}: {asleep:?}"
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn gangs_and_singles_keep_every_gpu_in_budget_and_every_gang_whole(
        ops in ops(),
        grouped in any::<bool>(),
    ) {
        let mut n = property_node();
        // Two PCIe roots of two GPUs each: no gang spans them (g3, of
        // three, never fits one).
        let groups: Vec<Option<String>> = ["r0", "r0", "r1", "r1"]
            .map(|g| grouped.then(|| g.to_owned()))
            .to_vec();
        n.set_groups(groups.clone());
        for op in ops {
            let before = residents(&n);
            match op {
                Op::Request(g, m) => {
                    let name = MODELS[m].0;
                    match n.request(g, name) {
                        NodeAdmission::Queued | NodeAdmission::GangRefused(_) => {
                            // Nothing moved anywhere.
                            prop_assert_eq!(residents(&n), before);
                        }
                        NodeAdmission::Hit { gpus }
                        | NodeAdmission::Loaded { gpus, .. }
                        | NodeAdmission::Woken { gpus, .. } => {
                            let width = n.width(name).unwrap_or(1);
                            prop_assert_eq!(gpus.len(), width);
                            for g in gpus {
                                let id = n.gpus()[g].id(name).unwrap();
                                prop_assert!(n.gpus()[g].is_resident(id));
                                prop_assert!(!n.gpus()[g].is_asleep(id));
                            }
                        }
                        NodeAdmission::Refused(_) => {
                            prop_assert_eq!(residents(&n), before);
                        }
                    }
                }
                Op::Unload(m) => {
                    n.unload(MODELS[m].0);
                    prop_assert!(n.members(MODELS[m].0).is_empty());
                }
                Op::Retire(g, m) => {
                    n.retire(g, MODELS[m].0);
                }
                Op::Budget(g, b) => {
                    n.set_budget(g, b * GIB);
                }
                Op::Loading(m, l) => n.set_loading(MODELS[m].0, l),
            }
            check(&n)?;
            for gang in ["g2", "g3", "g2b"] {
                let members = n.members(gang);
                prop_assert!(
                    members.windows(2).all(|w| groups[w[0]] == groups[w[1]]),
                    "{} spans groups: {:?}", gang, members
                );
            }
        }
    }
}

#[test]
fn a_gang_stays_inside_one_group_of_gpus() {
    // Four GPUs of 24 GiB in two groups (NVLink domains): 0-1 and 2-3.
    let groups = || {
        ["nvl-0", "nvl-0", "nvl-1", "nvl-1"]
            .map(|g| Some(g.to_owned()))
            .to_vec()
    };
    let mut n = node(4, 24, &[("tp2", 16), ("a", 16), ("c", 16)], &[("tp2", 2)]);
    n.set_groups(groups());
    assert!(matches!(n.request(0, "a"), NodeAdmission::Loaded { .. }));
    assert!(matches!(n.request(2, "c"), NodeAdmission::Loaded { .. }));
    // Ungrouped it would take the two free GPUs, 1 and 3; grouped, one
    // group must evict: the one whose eviction was used longest ago (a).
    assert_eq!(
        n.request(0, "tp2"),
        NodeAdmission::Loaded {
            gpus: vec![0, 1],
            evicted: vec![(0, "a".to_owned())]
        }
    );
    // Three GPUs of one group do not exist: refused, saying so.
    let mut wide = node(4, 24, &[("tp3", 16)], &[("tp3", 3)]);
    wide.set_groups(groups());
    let NodeAdmission::GangRefused(r) = wide.request(0, "tp3") else {
        panic!("refused");
    };
    assert!(r.grouped && r.could == 2, "{r:?}");
    assert!(r.to_string().contains("at most 2 of one group"), "{r}");
    // GPUs without a group go only with each other.
    let mut mixed = node(3, 24, &[("tp2", 16)], &[("tp2", 2)]);
    mixed.set_groups(vec![Some("nvl-0".into()), None, None]);
    assert_eq!(
        mixed.request(0, "tp2"),
        NodeAdmission::Loaded {
            gpus: vec![1, 2],
            evicted: vec![]
        }
    );
}
