//! The two reads of the OCI distribution API the agent makes: a manifest,
//! and a blob from an offset. oci-client logs in (its `auth` handshake:
//! the `WWW-Authenticate` challenge and the token) but its pulls follow
//! every redirect to any host and read a manifest whole before anyone can
//! check its size, so the GETs themselves are made here, with the agent's
//! limits:
//!
//! - a redirect is followed only by the agent's one rule
//!   ([`super::transport`]): to the registry itself or under an allowed
//!   http(s) source;
//! - a manifest is read up to its limit and no further;
//! - a descriptor's `urls` (foreign layers) are never fetched: a blob
//!   comes from the registry that named it.

use oci_client::errors::{OciDistributionError, OciEnvelope};
use oci_client::secrets::RegistryAuth;
use oci_client::{Reference, RegistryOperation};
use reqwest::header::{ACCEPT, AUTHORIZATION, HeaderValue, RANGE};

/// What a read can fail with, before the artifact's reasons are given.
#[derive(Debug)]
pub enum ReadError {
    /// The registry answered with an error status (its envelope, if any).
    Registry(OciDistributionError),
    /// A redirect the agent does not follow, and why.
    Redirect { uri: String, why: String },
    /// The body was larger than the limit: how much was read.
    TooLarge { bytes: usize },
    /// The connection or the body broke.
    Transfer(String),
}

/// One logged-in conversation with a repository.
pub struct Session {
    http: reqwest::Client,
    /// `https://<registry>/v2/<repository>`.
    base: String,
    authorization: Option<HeaderValue>,
}

impl Session {
    /// Logs in to `reference`'s registry for pulls (a bearer token if the
    /// registry asks for one; basic credentials are sent as they are).
    pub async fn open(
        http: reqwest::Client,
        oci: &oci_client::Client,
        reference: &Reference,
        auth: &RegistryAuth,
    ) -> Result<Session, ReadError> {
        let token = oci
            .auth(reference, auth, RegistryOperation::Pull)
            .await
            .map_err(ReadError::Registry)?;
        let authorization = match (token, auth) {
            (Some(token), _) => Some(format!("Bearer {token}")),
            (None, RegistryAuth::Basic(user, password)) => {
                use base64::Engine;
                let pair = format!("{user}:{password}");
                Some(format!(
                    "Basic {}",
                    base64::engine::general_purpose::STANDARD.encode(pair)
                ))
            }
            (None, _) => None,
        };
        let authorization = authorization
            .map(|v| HeaderValue::from_str(&v))
            .transpose()
            .map_err(|e| ReadError::Transfer(format!("a credential that is not a header: {e}")))?;
        Ok(Session {
            http,
            base: format!(
                "https://{}/v2/{}",
                reference.resolve_registry(),
                reference.repository()
            ),
            authorization,
        })
    }

    async fn get(
        &self,
        path: &str,
        headers: &[(reqwest::header::HeaderName, String)],
    ) -> Result<reqwest::Response, ReadError> {
        let url = format!("{}/{path}", self.base);
        let mut request = self.http.get(&url);
        if let Some(a) = &self.authorization {
            request = request.header(AUTHORIZATION, a.clone());
        }
        for (name, value) in headers {
            request = request.header(name, value);
        }
        request
            .send()
            .await
            .map_err(|e| match super::transport::redirect_reason(&e) {
                Some(why) => ReadError::Redirect {
                    uri: url.clone(),
                    why,
                },
                None => ReadError::Transfer(super::fetch::error_chain(&e)),
            })
    }

    /// The manifest named by `tag_or_digest` and the sha256 of its bytes;
    /// reading stops past `limit` bytes.
    pub async fn manifest(
        &self,
        tag_or_digest: &str,
        accept: &[&str],
        limit: usize,
    ) -> Result<(bytes::Bytes, String), ReadError> {
        let mut response = self
            .get(
                &format!("manifests/{tag_or_digest}"),
                &[(ACCEPT, accept.join(", "))],
            )
            .await?;
        if !response.status().is_success() {
            return Err(status_error(response).await);
        }
        let body = read_capped(&mut response, limit).await?;
        let digest = ring::digest::digest(&ring::digest::SHA256, &body);
        let digest = format!("sha256:{}", super::fetch::encode_hex(digest.as_ref()));
        Ok((body, digest))
    }

    /// The blob `digest` from `offset` on: the answer and whether it is
    /// the part asked for (206 from `offset`) rather than the whole blob.
    pub async fn blob(
        &self,
        digest: &str,
        offset: u64,
    ) -> Result<(reqwest::Response, bool), ReadError> {
        let range = (offset > 0).then(|| (RANGE, format!("bytes={offset}-")));
        let response = self
            .get(&format!("blobs/{digest}"), range.as_slice())
            .await?;
        match response.status().as_u16() {
            200 => Ok((response, false)),
            206 => {
                let from_offset = super::fetch::range_starts_at(response.headers(), offset);
                if !from_offset {
                    return Err(ReadError::Transfer(format!(
                        "blob {digest}: a partial answer that does not start at byte {offset}"
                    )));
                }
                Ok((response, true))
            }
            _ => Err(status_error(response).await),
        }
    }
}

/// The body, read until it ends or passes `limit` bytes.
pub async fn read_capped(
    response: &mut reqwest::Response,
    limit: usize,
) -> Result<bytes::Bytes, ReadError> {
    let mut body = bytes::BytesMut::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| ReadError::Transfer(super::fetch::error_chain(&e)))?
    {
        body.extend_from_slice(&chunk);
        if body.len() > limit {
            return Err(ReadError::TooLarge { bytes: body.len() });
        }
    }
    Ok(body.freeze())
}

/// An error status as oci-client reports it: the registry's error
/// envelope when its body is one (read up to 64 KiB), else the status.
async fn status_error(mut response: reqwest::Response) -> ReadError {
    let status = response.status().as_u16();
    let url = response.url().to_string();
    if status == 401 {
        return ReadError::Registry(OciDistributionError::UnauthorizedError { url });
    }
    let body = read_capped(&mut response, 64 << 10)
        .await
        .unwrap_or_default();
    let error = match serde_json::from_slice::<OciEnvelope>(&body) {
        Ok(envelope) if (400..500).contains(&status) => {
            OciDistributionError::RegistryError { envelope, url }
        }
        _ => OciDistributionError::ServerError {
            code: status,
            url,
            message: String::from_utf8_lossy(&body).into_owned(),
        },
    };
    ReadError::Registry(error)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server on loopback that answers one request with a body that
    /// does not end (up to 256 MiB); what it managed to send.
    async fn endless_server() -> (String, tokio::task::JoinHandle<usize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sent = tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 4096];
            let _ = conn.read(&mut request).await;
            let head = "HTTP/1.1 200 OK\r\ncontent-type: application/vnd.oci.image.manifest.v1+json\r\n\r\n";
            conn.write_all(head.as_bytes()).await.unwrap();
            let chunk = vec![b' '; 64 << 10];
            let mut sent = 0;
            while sent < 256 << 20 {
                if conn.write_all(&chunk).await.is_err() {
                    break;
                }
                sent += chunk.len();
            }
            sent
        });
        (format!("http://{addr}/v2/models/x"), sent)
    }

    #[tokio::test]
    async fn a_manifest_without_end_is_read_to_its_limit_and_no_further() {
        let (base, sent) = endless_server().await;
        let session = Session {
            http: super::super::transport::client(
                super::super::transport::Reads::Registry,
                None,
                &[],
            )
            .unwrap(),
            base,
            authorization: None,
        };
        let limit = 4 << 20;
        let got = session.manifest("v1", &["application/json"], limit).await;
        let Err(ReadError::TooLarge { bytes }) = got else {
            panic!("{got:?}");
        };
        assert!(bytes > limit && bytes <= limit + (1 << 20), "{bytes}");
        // The agent hung up: the server could not send its 256 MiB.
        let sent = sent.await.unwrap();
        assert!(sent < 64 << 20, "the server sent {sent} bytes");
    }
}
