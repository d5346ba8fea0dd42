//! The control plane's processes: each started in its own process group,
//! owned (killed with the test that started it), its log kept for a
//! failure's report, its CPU time readable.

use super::*;

/// A child process started by this module.
pub(super) struct Process {
    pub(super) name: &'static str,
    pub(super) child: Option<Child>,
    pub(super) log: PathBuf,
}

impl Process {
    pub(super) fn not_started(name: &'static str, dir: &Path) -> Self {
        Process {
            name,
            child: None,
            log: dir.join(format!("{name}.log")),
        }
    }

    pub(super) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub(super) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub(super) fn exited(&mut self) -> bool {
        match &mut self.child {
            Some(c) => !matches!(c.try_wait(), Ok(None)),
            None => true,
        }
    }

    pub(super) fn log_tail(&self) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

/// Spawns a process that is killed (SIGKILL) when this process dies, however
/// it dies: for every helper process a test, benchmark or the demo starts.
/// Spawning happens on one thread that never exits, because
/// `PR_SET_PDEATHSIG` fires when the *spawning thread* dies.
#[allow(unsafe_code)] // a libc call std has no safe wrapper for
pub fn spawn_owned(mut cmd: Command) -> std::io::Result<Child> {
    type Request = (Command, mpsc::Sender<std::io::Result<Child>>);
    static SPAWNER: std::sync::OnceLock<std::sync::Mutex<mpsc::Sender<Request>>> =
        std::sync::OnceLock::new();
    let sender = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("control-plane-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
                // The sender lives in a static: the loop only ends at exit.
            })
            .expect("spawn thread");
        std::sync::Mutex::new(tx)
    });
    // SAFETY: prctl is async-signal-safe; no allocation happens in the hook.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let (tx, rx) = mpsc::channel();
    sender
        .lock()
        .map_err(|_| std::io::Error::other("spawner lock poisoned"))?
        .send((cmd, tx))
        .map_err(|_| std::io::Error::other("spawner thread gone"))?;
    rx.recv()
        .map_err(|_| std::io::Error::other("spawner thread gone"))?
}

pub(super) fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The version a Kubernetes binary reports (`Kubernetes v1.37.2`).
pub(super) fn binary_version(binary: &Path) -> Option<String> {
    let out = Command::new(binary).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .find(|w| w.starts_with("v1."))
        .map(str::to_owned)
}

pub(super) fn start_process(
    name: &'static str,
    binary: &Path,
    args: &[String],
    dir: &Path,
) -> std::io::Result<Process> {
    let log = dir.join(format!("{name}.log"));
    let out = fs::File::create(&log)?;
    let mut cmd = Command::new(binary);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        // Not in the terminal's process group: Ctrl-C reaches the owner,
        // whose death then takes these down in order.
        .process_group(0);
    let child = spawn_owned(cmd).map_err(|e| {
        std::io::Error::new(e.kind(), format!("cannot start {}: {e}", binary.display()))
    })?;
    Ok(Process {
        name,
        child: Some(child),
        log,
    })
}

/// User plus system CPU seconds from a `/proc/.../stat` file (a process's
/// or a thread's): its 14th and 15th fields, counted after the command
/// name's closing parenthesis (a name may hold spaces).
#[allow(unsafe_code)] // a libc call std has no safe wrapper for
pub fn cpu_seconds_of(stat: &Path) -> Option<f64> {
    let text = fs::read_to_string(stat).ok()?;
    let fields: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf reads a constant of the running system.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (per_second > 0).then(|| ticks / per_second as f64)
}
