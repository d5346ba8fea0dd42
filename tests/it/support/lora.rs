//! LoRA adapters made by the tests, on the disk, for the fake model server
//! (which reads their config) and real vLLM (which reads it all).

use serde_json::json;
use std::path::Path;

/// LoRA adapters for the tiny model of scripts/tiny-model.py, written as
/// PEFT does (its config and a safetensors file of the A and B matrices of
/// `q_proj` and `v_proj` in both layers, pseudo-random weights of about
/// 0.5 drawn from each one's seed, so each changes the model's output its
/// own way): (name, rank, seed), each in a directory of its name.
pub fn write_adapters(dir: &Path, base: &str, adapters: &[(&str, u64, u64)]) {
    for &(name, rank, seed) in adapters {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        let config = json!({"peft_type": "LORA", "r": rank, "lora_alpha": 16,
            "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM", "bias": "none",
            "base_model_name_or_path": base});
        std::fs::write(d.join("adapter_config.json"), config.to_string()).unwrap();
        // Hidden size 128; v_proj's output is 2 KV heads of 32.
        let mut tensors = Vec::new();
        for layer in 0..2 {
            for (proj, out) in [("q_proj", 128u64), ("v_proj", 64)] {
                let key = |ab: &str| {
                    format!(
                        "base_model.model.model.layers.{layer}.self_attn.{proj}.lora_{ab}.weight"
                    )
                };
                tensors.push((key("A"), vec![rank, 128]));
                tensors.push((key("B"), vec![out, rank]));
            }
        }
        std::fs::write(
            d.join("adapter_model.safetensors"),
            safetensors(&tensors, seed),
        )
        .unwrap();
    }
}

/// A safetensors file of f32 tensors with the given names and shapes,
/// filled from a linear congruential sequence in [-0.5, 0.5).
fn safetensors(tensors: &[(String, Vec<u64>)], seed: u64) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    let mut x = seed;
    for (name, shape) in tensors {
        let start = data.len();
        for _ in 0..shape.iter().product::<u64>() {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let v = ((x >> 40) as f32 / (1u64 << 24) as f32) - 0.5;
            data.extend_from_slice(&v.to_le_bytes());
        }
        header.insert(
            name.clone(),
            json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut head = serde_json::Value::Object(header).to_string().into_bytes();
    while !head.len().is_multiple_of(8) {
        head.push(b' ');
    }
    let mut file = (head.len() as u64).to_le_bytes().to_vec();
    file.extend(head);
    file.extend(data);
    file
}
