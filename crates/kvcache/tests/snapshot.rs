//! Index snapshots: a restored index answers every query exactly as the original.
#![cfg(feature = "serde")]

use kvblock::BlockHash;
use kvcache::{CacheIndex, Error, IndexSnapshot, KvEvent, WorkerId, SNAPSHOT_VERSION};
use proptest::prelude::*;

fn events() -> impl Strategy<Value = Vec<(u64, KvEvent)>> {
    let worker = prop_oneof![0u64..4, 60u64..70, Just(500u64)];
    let blocks = prop::collection::vec((0u64..40).prop_map(BlockHash::new), 1..8);
    let event = prop_oneof![
        4 => blocks.clone().prop_map(|blocks| KvEvent::Stored { parent: None, blocks }),
        2 => blocks.prop_map(|blocks| KvEvent::Removed { blocks }),
        1 => Just(KvEvent::Cleared),
    ];
    prop::collection::vec((worker, event), 0..80)
}

proptest! {
    #[test]
    fn restored_index_answers_like_the_original(evs in events(), gaps in prop::collection::vec(any::<bool>(), 80),
                                                queries in prop::collection::vec(prop::collection::vec((0u64..40).prop_map(BlockHash::new), 1..8), 8)) {
        let mut index = CacheIndex::new();
        for (i, (w, ev)) in evs.iter().enumerate() {
            let w = WorkerId::new(*w);
            let next = index.next_event_id(w).unwrap_or(0);
            let id = next + u64::from(gaps[i]);
            let _ = index.apply(w, id, ev);
        }
        let json = serde_json::to_string(&index.snapshot()).expect("serializes");
        let snap: IndexSnapshot = serde_json::from_str(&json).expect("parses");
        let restored = CacheIndex::restore(snap).expect("restores");
        restored.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(restored.snapshot(), index.snapshot());
        prop_assert_eq!(restored.workers(), index.workers());
        prop_assert_eq!(restored.pairs(), index.pairs());
        for w in index.workers() {
            prop_assert_eq!(restored.block_count(w), index.block_count(w));
            prop_assert_eq!(restored.next_event_id(w), index.next_event_id(w));
            prop_assert_eq!(restored.is_stale(w), index.is_stale(w));
        }
        for q in &queries {
            let (a, b) = (index.overlaps(q), restored.overlaps(q));
            for w in index.workers() {
                prop_assert_eq!(a.get(w), b.get(w));
            }
        }
    }
}

#[test]
fn unknown_version_and_corrupt_snapshots_are_errors() {
    let mut index = CacheIndex::new();
    index
        .apply(
            WorkerId::new(1),
            0,
            &KvEvent::Stored {
                parent: None,
                blocks: vec![BlockHash::new(9)],
            },
        )
        .unwrap();
    let good = serde_json::to_value(index.snapshot()).unwrap();
    assert_eq!(good["version"], SNAPSHOT_VERSION);

    let mut future = good.clone();
    future["version"] = 99.into();
    let e = CacheIndex::restore(serde_json::from_value(future).unwrap()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "bad index snapshot: version 99 is not supported (this build reads version 1)"
    );

    let mut twice = good.clone();
    let w = twice["workers"][0].clone();
    twice["workers"].as_array_mut().unwrap().push(w);
    assert!(matches!(
        CacheIndex::restore(serde_json::from_value(twice).unwrap()),
        Err(Error::BadSnapshot { .. })
    ));

    let mut dup = good.clone();
    dup["workers"][0]["blocks"] = serde_json::json!([9, 9]);
    let e = CacheIndex::restore(serde_json::from_value(dup).unwrap()).unwrap_err();
    assert!(e.to_string().contains("lists a block twice"), "{e}");

    let mut stray = good.clone();
    stray["run_hints"] = serde_json::json!([[9, 3], [12, 1]]);
    let e = CacheIndex::restore(serde_json::from_value(stray).unwrap()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "bad index snapshot: a run hint for 0x000000000000000c, which no worker holds"
    );

    // Truncated or mistyped data never reaches restore: the serde format rejects it.
    let text = serde_json::to_string(&good).unwrap();
    assert!(serde_json::from_str::<IndexSnapshot>(&text[..text.len() / 2]).is_err());
    assert!(serde_json::from_str::<IndexSnapshot>(
        r#"{"version": 1, "workers": [{"worker": "x"}]}"#
    )
    .is_err());
}

/// Run hints survive a snapshot (a restored router probes where the original did), and a
/// snapshot written before they existed still restores, without them.
#[test]
fn run_hints_round_trip_and_old_snapshots_restore() {
    let b = |i: u64| BlockHash::new(i);
    let mut index = CacheIndex::new();
    let blocks: Vec<BlockHash> = (1..=5).map(b).collect();
    let stored = KvEvent::Stored {
        parent: None,
        blocks: blocks.clone(),
    };
    index.apply(WorkerId::new(3), 0, &stored).unwrap();
    let snap = index.snapshot();
    // Block i of the five-block event went on for 5 - i more: the last one (4 more) is left out.
    let want: Vec<(BlockHash, u16)> = (1..=4).map(|i| (b(i), 5 - i as u16)).collect();
    assert_eq!(snap.run_hints, want);
    assert_eq!(CacheIndex::restore(snap.clone()).unwrap().snapshot(), snap);

    let mut old = serde_json::to_value(&snap).unwrap();
    old.as_object_mut().unwrap().remove("run_hints");
    let restored = CacheIndex::restore(serde_json::from_value(old).unwrap()).unwrap();
    assert!(restored.snapshot().run_hints.is_empty());
    assert_eq!(restored.overlaps(&blocks).get(WorkerId::new(3)), 5);
}
