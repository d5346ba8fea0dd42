//! Keys and certificates for the local components (the API server's front
//! proxy, the test registry, KEDA), made with the `openssl` command.

use std::path::Path;
use std::process::{Command, Stdio};

/// Makes a P-256 key and certificate, `NAME.key` and `NAME.crt` in `dir`,
/// for common name `cn`: its own CA when `ca` is `None`, else a leaf
/// issued by the CA `CA.crt`/`CA.key` in `dir`, with `extensions` (as
/// openssl's `-addext` takes them: `subjectAltName=DNS:localhost`).
pub fn issue_certificate(
    dir: &Path,
    name: &str,
    cn: &str,
    ca: Option<&str>,
    extensions: &[&str],
) -> std::io::Result<()> {
    let (key, crt, subject) = (
        format!("{name}.key"),
        format!("{name}.crt"),
        format!("/CN={cn}"),
    );
    let mut args: Vec<String> = [
        "req",
        "-x509",
        "-nodes",
        "-days",
        "3650",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-keyout",
        &key,
        "-out",
        &crt,
        "-subj",
        &subject,
    ]
    .map(str::to_owned)
    .into();
    if let Some(ca) = ca {
        args.extend([
            "-CA".into(),
            format!("{ca}.crt"),
            "-CAkey".into(),
            format!("{ca}.key"),
        ]);
        args.extend([
            "-addext".into(),
            "basicConstraints=critical,CA:FALSE".into(),
        ]);
    }
    for e in extensions {
        args.extend(["-addext".into(), (*e).to_owned()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    openssl(dir, &args)
}

/// Runs `openssl ARGS` in `dir`; its output goes nowhere unless it fails.
pub fn openssl(dir: &Path, args: &[&str]) -> std::io::Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "openssl {} failed: {}",
            args.first().unwrap_or(&""),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}
