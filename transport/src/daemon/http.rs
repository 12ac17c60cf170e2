//! `/stats`, `/metrics`, `/health` and `/ready` over hyper (HTTP/1.1), read-only.

use super::budget::Class;
use super::Inner;
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// Serves `/stats`, `/metrics`, `/health` and `/ready` with hyper (HTTP/1.1). Read-only: the
/// ring is frozen and unfrozen over the Unix socket, which only this user can reach. `/ready`
/// answers 200 when this daemon is a member and has just completed an authenticated handshake
/// with every other member, else 503; both with a [`ReadyDoc`](crate::ReadyDoc).
pub(super) async fn serve_http(inner: Arc<Inner>, l: TcpListener) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    loop {
        let Ok((s, from)) = l.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let Some(permit) = inner.conn_permit(Class::Http, Some(from.ip())) else {
            continue;
        };
        let inner2 = inner.clone();
        inner.spawn(async move {
            let inner = inner2;
            let _permit = permit;
            let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let inner = inner.clone();
                async move {
                    let r = if req.method() == hyper::Method::GET && req.uri().path() == "/ready" {
                        let d = inner.ready_doc().await;
                        let status = if d.ready {
                            hyper::StatusCode::OK
                        } else {
                            hyper::StatusCode::SERVICE_UNAVAILABLE
                        };
                        response(
                            status,
                            "application/json",
                            serde_json::to_string_pretty(&d).expect("json"),
                        )
                    } else {
                        http_route(&inner, &req)
                    };
                    Ok::<_, std::convert::Infallible>(r)
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(5))
                .max_buf_size(16 << 10)
                .serve_connection(TokioIo::new(s), svc);
            // A client that holds a connection open is cut off after a minute.
            let _ = tokio::time::timeout(Duration::from_secs(60), conn).await;
        });
    }
}

pub(super) fn http_route<B>(inner: &Inner, req: &hyper::Request<B>) -> hyper::Response<http_body_util::Full<Bytes>> {
    use hyper::{Method, StatusCode};
    let (status, ctype, body) = match (req.method(), req.uri().path()) {
        (&Method::GET, "/stats") => (
            StatusCode::OK,
            "application/json",
            serde_json::to_string_pretty(&inner.stats_doc()).expect("json"),
        ),
        (&Method::GET, "/metrics") => (
            StatusCode::OK,
            "text/plain; version=0.0.4",
            inner.stats_doc().prometheus(),
        ),
        (&Method::GET, "/health") => (StatusCode::OK, "text/plain", "ok\n".into()),
        (_, "/freeze" | "/unfreeze") => (
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "the ring is frozen over the daemon's Unix socket (ramjet.init / DaemonClient::freeze), not over HTTP\n"
                .into(),
        ),
        _ => (StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
    };
    response(status, ctype, body)
}

fn response(status: hyper::StatusCode, ctype: &str, body: String) -> hyper::Response<http_body_util::Full<Bytes>> {
    hyper::Response::builder()
        .status(status)
        .header("content-type", ctype)
        .body(http_body_util::Full::new(Bytes::from(body)))
        .expect("valid response")
}

#[cfg(test)]
mod tests {
    use crate::daemon::config::{read_members, url_under};

    /// Regression: `--allow s3://bucket/data` was a bare string prefix, and admitted
    /// `s3://bucket/database/..` and `s3://bucket/data-other/..`.
    #[test]
    pub(super) fn allow_prefixes_match_url_components_not_string_prefixes() {
        let p = "s3://bucket/data";
        assert!(url_under("s3://bucket/data/x/manifest.json", p));
        assert!(url_under("s3://bucket/data/manifest.json", "s3://bucket/data/"));
        for bad in [
            "s3://bucket/database/manifest.json",
            "s3://bucket/data-other/manifest.json",
            "s3://bucket-evil/data/manifest.json",
            "gs://bucket/data/manifest.json",
            "s3://user:pw@bucket/data/manifest.json",
            "s3://bucket/data/%2e%2e/secret/manifest.json",
            "s3://bucket/data/x/manifest.json?y=1",
            "not a url",
        ] {
            assert!(!url_under(bad, p), "{bad} admitted under {p}");
        }
        assert!(url_under("http://h:9000/b/d/m.json", "http://h:9000/b"));
        assert!(!url_under("http://h:9001/b/d/m.json", "http://h:9000/b"));
    }

    #[test]
    pub(super) fn member_files_take_hostlists_and_comments() {
        let m = read_members("# ring\nnode[01-02]:7341\n10.0.0.9:7000  # spare\n\n").unwrap();
        assert_eq!(m, ["node01:7341", "node02:7341", "10.0.0.9:7000"]);
        let m = read_members("n[1-2,4]:9,127.0.0.2:7341").unwrap();
        assert_eq!(m, ["n1:9", "n2:9", "n4:9", "127.0.0.2:7341"]);
        assert!(read_members("n[1-:7341").is_err());
    }
}
