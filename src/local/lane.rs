//! The real-node lane: a command run in network, mount and PID namespaces
//! of its own, so that a real kubelet and containerd can run under it
//! without touching the machine.
//!
//! - **Network.** A new network namespace with no uplink: its loopback,
//!   and a bridge [`BRIDGE`] with the node's address [`NODE_IP`] that the
//!   pods' veths join (Debian's bridge CNI plugin), and a route for the
//!   Services' addresses ([`SERVICE_SUBNET`]) that kube-proxy rewrites.
//!   The control plane, the node, the operator, the router and the tests
//!   all live in it, so every address they dial is the lane's own; nothing
//!   can reach the machine's interface or beyond.
//! - **Mounts.** A private mount namespace: the kubelet's and containerd's
//!   mounts (overlay root filesystems, volumes, the sysctl files
//!   [`super::real_node`] binds) die with it.
//! - **Processes.** A PID namespace whose first process is a shell that
//!   reaps orphans (containerd's shims are); when the command ends, the
//!   kernel kills everything left in the namespace, containers included.
//!
//! What the namespaces cannot take back are the cgroups the kubelet makes
//! under the lane's own cgroup root (`/<lane id>` in every hierarchy) and
//! the files the lane's processes write (their `TMPDIR` is a directory of
//! the lane's): [`run`] removes both once the command is over.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;

/// Set inside a lane to the lane's id (also its cgroup root's name).
pub const LANE_ENV: &str = "MODEL_RESIDENCY_LANE";
/// The lane's bridge, which pods' veths join.
pub const BRIDGE: &str = "mr0";
/// The node's address on the bridge (the pods' gateway).
pub const NODE_IP: &str = "10.88.0.1";
/// The pods' subnet on the bridge.
pub const POD_SUBNET: &str = "10.88.0.0/16";
/// The Services' cluster IPs (the API server's range). Routed to the
/// bridge in the lane, so that a connection from the lane's own processes
/// has a route for kube-proxy's rules to rewrite (pods route through the
/// node, their gateway).
pub const SERVICE_SUBNET: &str = "10.0.0.0/24";

/// The file in the lane's directory that holds the pid to enter it by.
const PID_FILE: &str = "lane.pid";

/// The pid (in the machine's view) whose network and mount namespaces are
/// the lane's, for `nsenter`, when this process runs in a lane.
pub fn entry_pid() -> Option<u32> {
    current()?;
    let dir = std::env::var_os("TMPDIR")?;
    std::fs::read_to_string(Path::new(&dir).join(PID_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The id of the lane this process runs in, if it does.
pub fn current() -> Option<String> {
    std::env::var(LANE_ENV).ok().filter(|id| is_lane_id(id))
}

fn is_lane_id(id: &str) -> bool {
    id.starts_with("model-residency-lane-")
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// Runs `command` in a new lane and waits for it; then removes the lane's
/// cgroups. Needs root (unshare and ip, from util-linux and iproute2).
pub fn run(command: &[OsString]) -> std::io::Result<ExitStatus> {
    let id = format!("model-residency-lane-{}", std::process::id());
    // Everything the lane's processes write goes under one directory
    // (TMPDIR), removed at the end: their janitors die with the lane.
    // Short: unix sockets under it (the kubelet's plugins') have 108 bytes.
    let dir = tempfile::Builder::new()
        .prefix(&format!("mr-lane-{}.", std::process::id()))
        .tempdir()?;
    // The shell is the namespace's init: it sets up the network, starts the
    // command, reaps orphans while it waits, and passes on its status.
    let setup = format!(
        "set -e; ip link set lo up; ip link add {BRIDGE} type bridge; \
         ip addr add {NODE_IP}/16 dev {BRIDGE}; ip link set {BRIDGE} up; \
         ip route add {SERVICE_SUBNET} dev {BRIDGE}; \
         set +e; child=; trap 'term=1; [ -n \"$child\" ] && kill -TERM $child' TERM INT; \
         \"$@\" & child=$!; [ -n \"$term\" ] && kill -TERM $child; \
         while :; do wait $child; status=$?; kill -0 $child 2>/dev/null || break; done; \
         exit $status"
    );
    let mut child = Command::new("unshare")
        .args([
            // unshare dying ends the lane's shell (and so the lane).
            "--kill-child=TERM",
            "--net",
            "--mount",
            "--propagation",
            "private",
            "--pid",
            "--fork",
            "--mount-proc",
            "--",
            "bash",
            "-c",
            &setup,
            "lane",
        ])
        .args(command)
        .env(LANE_ENV, &id)
        .env("TMPDIR", dir.path())
        .spawn()
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot run unshare: {e}")))?;
    // unshare itself is in the lane's network and mount namespaces: a
    // shell enters them by its pid (`nsenter --target PID --net --mount`).
    let _ = std::fs::write(dir.path().join(PID_FILE), child.id().to_string());
    pass_on_termination(child.id());
    let status = child.wait()?;
    remove_cgroups(Path::new("/sys/fs/cgroup"), &id);
    drop(dir);
    Ok(status)
}

/// A SIGTERM or SIGINT to this process is passed on to the lane's
/// `unshare` (pid `child`), which ends the lane's command, instead of
/// ending this process alone and leaving the whole lane running (etcd, the
/// API server, the kubelet, containerd and its containers: a `kill` of
/// `local-cluster --real-node` did). A thread of its own waits for them.
#[allow(unsafe_code)] // a libc call std has no safe wrapper for
fn pass_on_termination(child: u32) {
    let waiter = move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async {
            use tokio::signal::unix::{SignalKind, signal};
            let (Ok(mut term), Ok(mut int)) = (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) else {
                return;
            };
            loop {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
                // unshare ignores SIGTERM while it waits for its fork: the
                // TERM goes to the lane's shell (its child, the lane's
                // init), which passes it on to the command.
                for pid in children_of(child) {
                    // SAFETY: kill(2) with a pid read from /proc and a valid
                    // signal number; no memory is shared.
                    unsafe {
                        libc::kill(pid as libc::pid_t, libc::SIGTERM);
                    }
                }
            }
        });
    };
    let _ = std::thread::Builder::new()
        .name("lane-signals".into())
        .spawn(waiter);
}

/// The processes whose parent is `pid` (from /proc).
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            // /proc/P/stat: "P (comm) S PPID ...", comm may hold spaces.
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|stat| {
                    let rest = &stat[stat.rfind(')')? + 1..];
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(pid)
        })
        .collect()
}

/// The lane's cgroup root in each hierarchy under `base` that has one.
pub fn cgroup_roots(base: &Path, id: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(base) else {
        return Vec::new();
    };
    let mut roots: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path().join(id))
        .filter(|p| p.is_dir())
        .collect();
    if base.join("cgroup.procs").is_file() && base.join(id).is_dir() {
        // cgroup v2 alone: one hierarchy at the base.
        roots.push(base.join(id));
    }
    roots.sort();
    roots.dedup();
    roots
}

/// Kills whatever is left in the lane's cgroups and removes them, deepest
/// first (a cgroup can be removed only once it has no children and no
/// processes).
pub fn remove_cgroups(base: &Path, id: &str) {
    for root in cgroup_roots(base, id) {
        let mut dirs = Vec::new();
        collect_dirs(&root, &mut dirs);
        for dir in &dirs {
            kill_members(dir);
        }
        // Deepest first: a child's path is longer than its parent's.
        dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        for dir in &dirs {
            for _ in 0..20 {
                if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn collect_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_owned());
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                collect_dirs(&e.path(), out);
            }
        }
    }
}

#[allow(unsafe_code)] // a libc call std has no safe wrapper for
fn kill_members(dir: &Path) {
    let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) else {
        return;
    };
    for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
        // SAFETY: kill(2) with a pid read from the lane's own cgroup.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_lane_id_names_a_cgroup() {
        assert!(is_lane_id("model-residency-lane-42"));
        assert!(!is_lane_id("model-residency-lane-../../x"));
        assert!(!is_lane_id("kubepods"));
    }

    #[test]
    fn the_lanes_cgroups_go_deepest_first_and_nothing_else() {
        let base = tempfile::tempdir().unwrap();
        let id = "model-residency-lane-7";
        for hierarchy in ["memory", "cpu"] {
            std::fs::create_dir_all(base.path().join(hierarchy).join(id).join("kubepods/pod1"))
                .unwrap();
            std::fs::create_dir_all(base.path().join(hierarchy).join("other")).unwrap();
        }
        assert_eq!(cgroup_roots(base.path(), id).len(), 2);
        remove_cgroups(base.path(), id);
        for hierarchy in ["memory", "cpu"] {
            assert!(!base.path().join(hierarchy).join(id).exists());
            assert!(base.path().join(hierarchy).join("other").exists());
        }
    }
}
