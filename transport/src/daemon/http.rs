//! The daemon's HTTP port over hyper (HTTP/1.1), read-only: the dashboard (`/`), `/cluster`,
//! `/jobs`, `/stats`, `/metrics`, and the open probes `/health` and `/ready`.
//!
//! With an API key and a port that is not on loopback, everything but the probes asks for the
//! read-only credential derived from the key ([`crate::wire::ApiKey::http_token`], printed by
//! `ramjet token`): `Authorization: Bearer <token>` (a Prometheus scraper, `curl`, `ramjet
//! stats`), or the `ramjet_token` cookie that opening `/?token=<token>` sets (a browser). A
//! request without it gets 401 and nothing else.

use super::budget::Class;
use super::Inner;
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// The dashboard page: HTML, CSS and JS in one file, built into the binary (nothing is
/// fetched from anywhere else).
const PAGE: &str = include_str!("page/index.html");

type Resp = hyper::Response<http_body_util::Full<Bytes>>;

/// Serves the HTTP port (see the module docs). Read-only: the ring is frozen and unfrozen over
/// the Unix socket, which only this user can reach. `/ready` answers 200 when this daemon is a
/// member and completed an authenticated handshake with every other member in its last probe
/// (at most a few seconds old: `super::ready`), else 503; both with a
/// [`ReadyDoc`](crate::ReadyDoc).
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
                async move { Ok::<_, std::convert::Infallible>(route(&inner, &req).await) }
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

/// Whether this port asks for the credential: a key is set and the port is not on loopback.
fn guarded(inner: &Inner) -> bool {
    inner.cfg.api_key.is_some() && inner.cfg.http.is_some_and(|a| !a.ip().is_loopback())
}

/// The credential a request carries: its bearer token, else its `ramjet_token` cookie.
fn credential<B>(req: &hyper::Request<B>) -> Option<String> {
    let h = req.headers();
    if let Some(v) = h.get(hyper::header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        if let Some(t) = v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")) {
            return Some(t.trim().to_string());
        }
    }
    h.get_all(hyper::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| c.trim().strip_prefix("ramjet_token=").map(str::to_string))
}

/// `token=` in the query, if any.
fn query_token<B>(req: &hyper::Request<B>) -> Option<String> {
    req.uri()
        .query()?
        .split('&')
        .find_map(|kv| kv.strip_prefix("token=").map(str::to_string))
}

fn valid(inner: &Inner, token: &str) -> bool {
    inner.cfg.api_key.as_ref().is_some_and(|k| k.check_http_token(token))
}

/// Whether the request reads (`GET`, or `HEAD`: the same answer without its body, which hyper
/// leaves out).
fn reads<B>(req: &hyper::Request<B>) -> bool {
    matches!(*req.method(), hyper::Method::GET | hyper::Method::HEAD)
}

/// Whether `Host` names this daemon by address: an IP literal (with or without a port) or
/// `localhost`. On a port without a credential this is what stops DNS rebinding: a page on
/// `evil.example` that rebinds its name to 127.0.0.1 sends `Host: evil.example`, and gets
/// nothing. A request without `Host` (HTTP/1.0) is refused too.
fn host_is_an_address<B>(req: &hyper::Request<B>) -> bool {
    let Some(h) = req.headers().get(hyper::header::HOST).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let h = h.trim();
    if h.parse::<std::net::SocketAddr>().is_ok() || h.parse::<std::net::IpAddr>().is_ok() {
        return true;
    }
    let name = h
        .rsplit_once(':')
        .map_or(h, |(n, port)| if port.parse::<u16>().is_ok() { n } else { h });
    let name = name.trim_start_matches('[').trim_end_matches(']');
    name.parse::<std::net::IpAddr>().is_ok() || name.eq_ignore_ascii_case("localhost")
}

async fn route<B>(inner: &Arc<Inner>, req: &hyper::Request<B>) -> Resp {
    use hyper::StatusCode;
    let path = req.uri().path();
    if reads(req) && path == "/ready" {
        let wait = inner.link.peer_timeout + Duration::from_secs(1);
        let d = inner.readiness.answer(&inner.me, wait).await;
        let status = if d.ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        return response(
            status,
            "application/json",
            serde_json::to_string_pretty(&d).expect("json"),
        );
    }
    if reads(req) && path == "/health" {
        return response(StatusCode::OK, "text/plain", "ok\n".into());
    }
    if !guarded(inner) && !host_is_an_address(req) {
        return response(
            StatusCode::FORBIDDEN,
            "text/plain",
            "403: on a port without a credential only a Host that is an IP address or localhost is \
             served (a guard against DNS rebinding); open the dashboard by its address\n"
                .into(),
        );
    }
    if guarded(inner) {
        // A browser opens the printed URL with `?token=`: the cookie is set, and the token
        // leaves the address bar.
        if let (true, Some(t)) = (path == "/", query_token(req)) {
            if valid(inner, &t) {
                return hyper::Response::builder()
                    .status(StatusCode::SEE_OTHER)
                    .header("location", "/")
                    .header(
                        "set-cookie",
                        format!("ramjet_token={t}; Path=/; HttpOnly; SameSite=Strict"),
                    )
                    .body(http_body_util::Full::new(Bytes::new()))
                    .expect("valid response");
            }
        }
        if !credential(req).is_some_and(|t| valid(inner, &t)) {
            return hyper::Response::builder()
                .status(StatusCode::UNAUTHORIZED)
                .header("www-authenticate", "Bearer realm=\"ramjet\"")
                .header("content-type", "text/plain")
                .body(http_body_util::Full::new(Bytes::from(
                    "401 unauthorized: this port needs the read credential (`ramjet token` prints it; \
                     send `Authorization: Bearer <token>`, or open /?token=<token> in a browser)\n",
                )))
                .expect("valid response");
        }
    }
    if reads(req) && path == "/cluster" {
        let d = inner.cluster().await;
        return response(
            StatusCode::OK,
            "application/json",
            serde_json::to_string(&d).expect("json"),
        );
    }
    http_route(inner, req)
}

pub(super) fn http_route<B>(inner: &Inner, req: &hyper::Request<B>) -> Resp {
    use hyper::{Method, StatusCode};
    let method = if reads(req) { &Method::GET } else { req.method() };
    let (status, ctype, body) = match (method, req.uri().path()) {
        (&Method::GET, "/stats") => (
            StatusCode::OK,
            "application/json",
            serde_json::to_string_pretty(&inner.stats_doc()).expect("json"),
        ),
        (&Method::GET, "/metrics") => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            crate::prometheus::exposition(&inner.stats_doc(), &inner.jobs.views(&inner.me, false)),
        ),
        (&Method::GET, "/jobs") => (
            StatusCode::OK,
            "application/json",
            serde_json::to_string_pretty(&inner.jobs.views(&inner.me, true)).expect("json"),
        ),
        (&Method::GET, "/" | "/index.html") => (StatusCode::OK, "text/html; charset=utf-8", PAGE.into()),
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

fn response(status: hyper::StatusCode, ctype: &str, body: String) -> Resp {
    hyper::Response::builder()
        .status(status)
        .header("content-type", ctype)
        .header("cache-control", "no-store")
        // The page loads nothing from anywhere but this daemon.
        .header(
            "content-security-policy",
            "default-src 'none'; connect-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src 'self'",
        )
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
