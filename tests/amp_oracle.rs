//! `rewrite --amp --lists tensorflow` decides like TensorFlow's Grappler pass on the
//! oracle graphs (../shared/oracle), and never uses more fp16 casts than it did.

mod common;

use ampgraph::passes::amp::{AmpConfig, AutoMixedPrecision};
use ampgraph::DType;

#[test]
fn agrees_with_tensorflow_on_the_oracle_cases() {
    let amp = AutoMixedPrecision::new(AmpConfig::with_profile(DType::F16, "tensorflow").unwrap());
    let (mut compared, mut agreed, mut ours_total, mut tf_total) = (0usize, 0usize, 0usize, 0usize);
    let mut disagreements = Vec::new();
    let mut over_budget = Vec::new();
    for (file, case) in common::oracle_cases() {
        let mut g = common::oracle_graph(&case);
        let report = amp.rewrite(&mut g).unwrap();
        g.validate().unwrap();
        for (name, want) in case["expected"].as_object().unwrap() {
            let id = g.require(name).unwrap();
            let got = g.node(id).outputs()[0].dtype.as_str();
            compared += 1;
            if got == want.as_str().unwrap() {
                agreed += 1;
            } else {
                disagreements.push(format!("{file}: {name} is {got}, TensorFlow {want}"));
            }
        }
        let tf = case["tf_casts_to_f16_excluding_const_and_variable"]
            .as_u64()
            .unwrap() as usize;
        let ours = report.stats.casts_to_half;
        ours_total += ours;
        tf_total += tf;
        if ours > tf {
            over_budget.push(format!("{file}: {ours} casts, TensorFlow {tf}"));
        }
    }
    println!("node decisions: {agreed}/{compared} agree; fp16 casts: ours {ours_total}, TensorFlow {tf_total}");
    assert!(
        compared > 3000,
        "the oracle set looks incomplete: {compared} decisions"
    );
    assert!(
        agreed as f64 >= 0.995 * compared as f64,
        "agreement {agreed}/{compared} is below 99.5%:\n{}",
        disagreements.join("\n")
    );
    assert!(
        over_budget.is_empty(),
        "more casts than TensorFlow:\n{}",
        over_budget.join("\n")
    );
}
