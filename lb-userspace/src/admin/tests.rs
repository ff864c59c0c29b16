use std::{collections::BTreeMap, io, time::Duration};

use hyper::header;
use serde_json::json;

use super::{testing::*, *};

fn chat() -> Value {
    json!({
        "vip": {"name": "chat", "address": "10.0.0.1", "port": 443, "protocol": "tcp"},
        "backends": [{"address": "10.1.0.1"}, {"address": "10.1.0.2", "weight": 50}],
    })
}

#[test]
fn every_endpoint_round_trips() {
    let srv = TestServer::start();
    let c = srv.client();

    let (st, v) = c.request("GET", "/v1/status", None).unwrap();
    assert_eq!(st, 200);
    assert_eq!(v["version"], "test");
    assert_eq!(v["vips"], 0);
    assert_eq!(v["interfaces"], json!([{"name": "eth0", "mode": "native"}]));
    assert_eq!(v["pin_dir"], "/sys/fs/bpf/sluice");
    assert_eq!(v["dataplane_reused"], false);

    let (st, v) = c.request("POST", "/v1/vips", Some(&chat())).unwrap();
    assert_eq!(st, 201, "{v}");
    assert_eq!(v["vip"]["name"], "chat");
    assert_eq!(v["vip"]["ring_size"], 65537);
    assert_eq!(v["backends"][1]["weight"], 50);
    assert!(
        v["vip"].get("traffic").is_none(),
        "changes carry no live counts"
    );

    let id1 = srv
        .state()
        .backend("chat", "10.1.0.1".parse().unwrap())
        .unwrap()
        .id;
    srv.ctl.blocking_lock().plane().flows = BTreeMap::from([(id1, 3)]);

    let (st, v) = c.request("GET", "/v1/vips", None).unwrap();
    assert_eq!(st, 200);
    assert_eq!(v["vips"][0]["name"], "chat");
    assert_eq!(v["vips"][0]["backend_count"], 2);
    assert_eq!(v["vips"][0]["active_flows"], 3);
    assert_eq!(v["vips"][0]["traffic"]["packets"], 0);

    let (st, v) = c.request("GET", "/v1/vips/chat", None).unwrap();
    assert_eq!(st, 200);
    assert_eq!(v["backends"][0]["active_flows"], 3);

    let new = json!({"address": "10.1.0.3", "labels": {"zone": "b"}, "max_sessions": 8});
    let (st, v) = c
        .request("POST", "/v1/vips/chat/backends", Some(&new))
        .unwrap();
    assert_eq!(st, 201, "{v}");
    assert_eq!(v["labels"]["zone"], "b");
    assert_eq!(v["weight"], 100);

    let (st, v) = c.request("GET", "/v1/vips/chat/backends", None).unwrap();
    assert_eq!(st, 200);
    let b = &v["backends"][0];
    assert_eq!(b["address"], "10.1.0.1");
    assert_eq!(b["id"], id1);
    assert_eq!(b["effective_weight"], 100);
    assert_eq!(b["state"], "active");
    assert_eq!(b["healthy"], true);
    assert_eq!(b["drain_since_ms"], Value::Null);
    assert_eq!(b["active_flows"], 3);
    assert_eq!(v["backends"].as_array().unwrap().len(), 3);

    let (st, v) = c
        .request("GET", "/v1/vips/chat/backends/10.1.0.3", None)
        .unwrap();
    assert_eq!((st, &v["max_sessions"]), (200, &json!(8)));

    let (st, v) = c
        .request(
            "PUT",
            "/v1/vips/chat/backends/10.1.0.3/weight",
            Some(&json!({"weight": 7})),
        )
        .unwrap();
    assert_eq!((st, &v["weight"]), (200, &json!(7)));

    let before = now_ms();
    let (st, v) = c
        .request(
            "POST",
            "/v1/vips/chat/backends/10.1.0.3/drain",
            Some(&json!({"deadline": "10m"})),
        )
        .unwrap();
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["state"], "draining");
    let deadline = v["drain_deadline_ms"].as_u64().unwrap();
    assert!((before + 600_000..=now_ms() + 600_000).contains(&deadline));

    let (st, v) = c
        .request("POST", "/v1/vips/chat/backends/10.1.0.3/undrain", None)
        .unwrap();
    assert_eq!((st, &v["state"]), (200, &json!("active")));

    // A drain without a body has no deadline.
    let (st, v) = c
        .request("POST", "/v1/vips/chat/backends/10.1.0.3/drain", None)
        .unwrap();
    assert_eq!((st, &v["drain_deadline_ms"]), (200, &Value::Null));

    let (st, v) = c
        .request("DELETE", "/v1/vips/chat/backends/10.1.0.3", None)
        .unwrap();
    assert_eq!((st, v), (204, Value::Null));
    let (st, _) = c
        .request("GET", "/v1/vips/chat/backends/10.1.0.3", None)
        .unwrap();
    assert_eq!(st, 404);

    let (st, v) = c.request("GET", "/v1/flows", None).unwrap();
    assert_eq!(st, 200);
    assert_eq!(v["vips"][0]["active_flows"], 3);
    assert_eq!(
        v["vips"][0]["backends"][0],
        json!({"address": "10.1.0.1", "id": id1, "active_flows": 3})
    );

    let (st, v) = c.request("GET", "/v1/stats", None).unwrap();
    assert_eq!(st, 200);
    assert!(v["global"].is_object());
    assert_eq!(
        v["vips"][0]["traffic"],
        json!({"packets": 0, "bytes": 0, "new_flows": 0, "handshakes": 0, "handshakes_completed": 0})
    );
    assert_eq!(v["vips"][0]["backends"][1]["address"], "10.1.0.2");

    srv.ctl.blocking_lock().record(crate::controller::Event {
        time_ms: 5,
        kind: "drain-complete".into(),
        vip: "chat".into(),
        backend: Some("10.1.0.3".parse().unwrap()),
        reason: "no active flows left".into(),
    });
    let (st, v) = c.request("GET", "/v1/events", None).unwrap();
    assert_eq!(st, 200);
    let kinds: Vec<&str> = v["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "drain-start",
            "undrain",
            "drain-start",
            "backend-removed",
            "drain-complete"
        ],
        "the requests above, then the recorded event"
    );
    assert_eq!(v["counts"]["drain-complete"], 1);

    let sample = json!({"kv_cache": 0.9, "queue_depth": 7});
    let (st, _) = c
        .request(
            "POST",
            "/v1/vips/chat/backends/10.1.0.1/telemetry",
            Some(&sample),
        )
        .unwrap();
    assert_eq!(st, 204, "a valid pushed sample is accepted");

    let (st, _) = c.request("DELETE", "/v1/vips/chat", None).unwrap();
    assert_eq!(st, 204);
    assert!(srv.state().vips.is_empty());
    let (_, v) = c.request("GET", "/v1/status", None).unwrap();
    assert_eq!((&v["vips"], &v["backends"]), (&json!(0), &json!(0)));
}

#[test]
fn rejected_requests_change_nothing_and_say_why() {
    let srv = TestServer::start();
    let c = srv.client();
    assert_eq!(c.request("POST", "/v1/vips", Some(&chat())).unwrap().0, 201);
    c.request("POST", "/v1/vips/chat/backends/10.1.0.2/drain", None)
        .unwrap();
    let other =
        json!({"vip": {"name": "other", "address": "10.0.0.9", "port": 80, "protocol": "tcp"}});
    assert_eq!(c.request("POST", "/v1/vips", Some(&other)).unwrap().0, 201);
    let before = srv.state();
    let big = vec![b' '; MAX_BODY + 1];
    // (method, path, body, status, what the error says)
    type Case<'a> = (&'a str, &'a str, Option<&'a [u8]>, u16, &'a str);
    let cases: &[Case] = &[
        ("POST", "/v1/vips", Some(b"{\"vip\": "), 400, "invalid JSON body: EOF while parsing"),
        ("POST", "/v1/vips", Some(b""), 400, "missing JSON body; expected {\"vip\""),
        ("POST", "/v1/vips", Some(b"\"chat\""), 400, "invalid JSON body: invalid type: string \"chat\", expected struct NewVip"),
        (
            "POST",
            "/v1/vips/chat/backends",
            Some(b"{\"address\": \"10.1.0.9\", \"colour\": 1}"),
            400,
            "unknown field `colour`",
        ),
        (
            "POST",
            "/v1/vips",
            Some(br#"{"vip": {"name": "chat", "address": "10.0.0.2", "port": 1, "protocol": "tcp"}}"#),
            409,
            "a VIP named \"chat\" exists already",
        ),
        (
            "POST",
            "/v1/vips",
            Some(br#"{"vip": {"name": "x", "address": "10.0.0.2", "port": 1, "protocol": "sctp"}}"#),
            400,
            "\"sctp\" is not recognised; allowed: \"tcp\", \"udp\"",
        ),
        (
            "PUT",
            "/v1/vips/chat/backends/10.1.0.1/weight",
            Some(b"{\"weight\": 70000}"),
            400,
            "weight: 70000 is out of range; allowed: 0..=65535 (0 = no new flows)",
        ),
        (
            "PUT",
            "/v1/vips/chat/backends/10.1.0.1/weight",
            Some(b"{\"weight\": \"heavy\"}"),
            400,
            "invalid type: string \"heavy\", expected u32",
        ),
        (
            "POST",
            "/v1/vips/chat/backends/10.1.0.1/drain",
            Some(b"{\"deadline\": \"soon\"}"),
            400,
            "deadline \"soon\" is not a duration",
        ),
        // A deadline this large must not wrap to a short one (which would end the backend's
        // streams at once).
        (
            "POST",
            "/v1/vips/chat/backends/10.1.0.1/drain",
            Some(b"{\"deadline\": \"18446744073709552s\"}"),
            400,
            "deadline \"18446744073709552s\" is longer than 365d",
        ),
        // The config file's rules, through the API (config::rules).
        (
            "POST",
            "/v1/vips/chat/backends",
            Some(br#"{"address": "10.1.0.9", "labels": {"rack": "r1\u001b]0;owned\u0007"}}"#),
            400,
            "is not a valid label value; allowed: 1 to 255 of A-Z",
        ),
        (
            "POST",
            "/v1/vips/chat/backends",
            Some(br#"{"address": "10.1.0.9", "labels": {"rack": "r1\nchat 10.6.6.6"}}"#),
            400,
            "is not a valid label value",
        ),
        (
            "POST",
            "/v1/vips/chat/backends",
            Some(br#"{"address": "255.255.255.255"}"#),
            400,
            "backend address \"255.255.255.255\" is the broadcast address",
        ),
        (
            "POST",
            "/v1/vips/chat/backends",
            Some(br#"{"address": "10.0.0.1"}"#),
            400,
            "backend address \"10.0.0.1\" is the VIP's own address",
        ),
        (
            "POST",
            "/v1/vips/chat/backends",
            Some(br#"{"address": "::ffff:10.1.0.9"}"#),
            400,
            "is an IPv4-mapped IPv6 address",
        ),
        (
            "POST",
            "/v1/vips/chat/backends",
            Some(br#"{"address": "240.0.0.7"}"#),
            400,
            "backend address \"240.0.0.7\" is in 240.0.0.0/4 (reserved)",
        ),
        (
            "POST",
            "/v1/vips/chat/backends",
            Some(br#"{"address": "169.254.1.1"}"#),
            400,
            "backend address \"169.254.1.1\" is link-local (169.254.0.0/16)",
        ),
        (
            "POST",
            "/v1/vips/chat/backends",
            Some(br#"{"address": "10.0.0.9"}"#),
            400,
            "backend address \"10.0.0.9\" is the address of VIP \"other\"",
        ),
        (
            "POST",
            "/v1/vips",
            Some(br#"{"vip": {"name": "lo", "address": "127.0.0.1", "port": 1, "protocol": "tcp"}}"#),
            400,
            "VIP address \"127.0.0.1\" is a loopback address",
        ),
        (
            "POST",
            "/v1/vips",
            Some(br#"{"vip": {"name": "lo6", "address": "::1", "port": 1, "protocol": "tcp"}}"#),
            400,
            "VIP address \"::1\" is a loopback address",
        ),
        (
            "POST",
            "/v1/vips",
            Some(br#"{"vip": {"name": "onb", "address": "10.1.0.1", "port": 1, "protocol": "tcp"}}"#),
            400,
            "VIP address \"10.1.0.1\" is a backend of VIP \"chat\"",
        ),
        (
            "POST",
            "/v1/vips",
            Some(br#"{"vip": {"name": "v6", "address": "fd00::10", "port": 1, "protocol": "tcp"}, "backends": [{"address": "fe80::1"}]}"#),
            400,
            "backend address \"fe80::1\" is link-local (fe80::/10)",
        ),
        (
            "POST",
            "/v1/vips",
            Some(br#"{"vip": {"name": "v6", "address": "fd00::10", "port": 1, "protocol": "tcp"}, "backends": [{"address": "64:ff9b::a01:1"}]}"#),
            400,
            "backend address \"64:ff9b::a01:1\" is in the NAT64 prefix 64:ff9b::/96",
        ),
        (
            "POST",
            "/v1/vips",
            Some(br#"{"vip": {"name": "bc", "address": "255.255.255.255", "port": 1, "protocol": "tcp"}}"#),
            400,
            "VIP address \"255.255.255.255\" is the broadcast address",
        ),
        (
            "POST",
            "/v1/vips/chat/backends/10.1.0.2/drain",
            None,
            409,
            "backend 10.1.0.2 of \"chat\" is already draining",
        ),
        ("POST", "/v1/vips/chat/backends/10.1.0.1/undrain", None, 409, "is not draining"),
        (
            "POST",
            "/v1/vips/chat/backends/10.1.0.1/telemetry",
            Some(b"{\"kv_cache\": 1.5}"),
            400,
            "kv_cache",
        ),
        (
            "POST",
            "/v1/vips/chat/backends/10.1.0.1/telemetry",
            Some(b"{\"temperature\": 80}"),
            400,
            "unknown field `temperature`",
        ),
        (
            "POST",
            "/v1/vips/chat/backends/10.9.9.9/telemetry",
            Some(b"{\"kv_cache\": 0.5}"),
            404,
            "has no backend 10.9.9.9",
        ),
        ("DELETE", "/v1/vips/chat/backends/10.9.9.9", None, 404, "VIP \"chat\" has no backend 10.9.9.9"),
        ("DELETE", "/v1/vips/nope", None, 404, "no VIP named \"nope\""),
        ("PUT", "/v1/vips/chat/backends/not-an-ip/weight", Some(b"{\"weight\": 1}"), 400, "\"not-an-ip\" is not an IP address"),
        ("GET", "/v1/vips/chat/backends/10.1.0.1/colour", None, 404, "no endpoint /v1/vips/chat/backends/10.1.0.1/colour"),
        ("GET", "/v2/status", None, 404, "no endpoint /v2/status"),
        ("GET", "/v1/vips/%zz", None, 400, "bad percent-encoding"),
        ("PATCH", "/v1/vips", Some(b"{}"), 405, "PATCH is not allowed here; use GET, POST"),
        ("POST", "/v1/vips", Some(&big), 413, "the request body is larger than 64 KiB"),
    ];
    for (method, path, body, status, message) in cases {
        let (st, v) = c.send(method, path, *body).unwrap();
        let got = v["error"].as_str().unwrap_or_default();
        assert_eq!(st, *status, "{method} {path}: {v}");
        assert!(
            got.contains(message),
            "{method} {path}: {got:?} lacks {message:?}"
        );
        assert_eq!(srv.state(), before, "{method} {path} changed the state");
    }
}

/// A local user must not hold admin connections without end (headers and part of a body, or
/// idle keep-alive) nor take as many as it likes: both are bounded. The deadlines asserted
/// are generous bounds, not timings.
#[test]
fn connections_are_capped_and_timed_out() {
    use std::{
        io::{Read, Write},
        os::unix::net::UnixStream,
    };
    let limits = ListenerLimits {
        max_connections: 3,
        max_per_peer: 2,
        request_timeout: Duration::from_millis(300),
    };
    let srv = TestServer::start_with(limits);
    let bound = Some(Duration::from_secs(10));
    let open = || {
        let s = UnixStream::connect(&srv.socket).unwrap();
        s.set_read_timeout(bound).unwrap();
        s
    };
    // Closed by the server: EOF (or a reset) before the bound, never a read timeout.
    let closed = |s: &mut UnixStream| {
        let mut buf = Vec::new();
        match s.read_to_end(&mut buf) {
            Ok(_) => String::from_utf8_lossy(&buf).into_owned(),
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => String::new(),
            Err(e) => panic!("not closed within {bound:?}: {e}"),
        }
    };
    // Headers and part of a body: answered 408 and closed.
    let mut partial = open();
    partial
        .write_all(b"POST /v1/vips HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"vip\"")
        .unwrap();
    let answer = closed(&mut partial);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer.contains("the request was not complete within 300ms"),
        "{answer}"
    );
    // Part of the headers only: closed.
    let mut slow = open();
    slow.write_all(b"GET /v1/status HTTP/1.1\r\nHo").unwrap();
    assert_eq!(closed(&mut slow), "");
    // A keep-alive connection answered once, then idle: closed.
    let mut idle = open();
    idle.write_all(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let answer = closed(&mut idle);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // Two held connections of this uid: a third is answered 503 and closed at once. (A slot
    // is freed just after its socket closes, so a held one is retried until answered.)
    let hold = || {
        for _ in 0..100 {
            let mut s = open();
            let _ = s.write_all(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n");
            let mut buf = [0u8; 12];
            if s.read_exact(&mut buf).is_ok() {
                assert_eq!(&buf, b"HTTP/1.1 200");
                return s;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("no slot came free");
    };
    let (a, b) = (hold(), hold());
    let before = srv.info.refused.get().0;
    let mut third = open();
    let _ = third.write_all(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n");
    let answer = closed(&mut third);
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("retry-after: 1"), "{answer}");
    assert!(
        answer.contains("the admin listener is at its connection cap"),
        "{answer}"
    );
    assert_eq!(srv.info.refused.get().0, before + 1);
    // Once they are gone the slots are free again.
    drop((a, b));
    let ok = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(20));
        srv.client()
            .request("GET", "/v1/status", None)
            .is_ok_and(|(st, _)| st == 200)
    });
    assert!(ok, "slots were not freed");
}

/// Random requests (methods, paths with encodings, bodies of every shape with arbitrary
/// strings and numbers) against the real server. Properties: each gets a JSON answer of a
/// status the API uses, never a 500; every error message is free of control characters;
/// whatever was accepted meets the validator's rules. 256 cases (PROPTEST_CASES overrides).
#[test]
fn random_requests_are_answered_and_accept_only_valid_state() {
    use proptest::{
        prelude::*,
        test_runner::{Config, TestRunner},
    };
    let srv = TestServer::start();
    let c = srv.client();
    assert_eq!(c.request("POST", "/v1/vips", Some(&chat())).unwrap().0, 201);
    let seg = prop::sample::select(vec![
        "vips",
        "chat",
        "backends",
        "10.1.0.1",
        "10.1.0.2",
        "10.1.0.9",
        "fd00::1",
        "%5Bfd00::1%5D",
        "%zz",
        "%00",
        "%1b",
        "weight",
        "drain",
        "undrain",
        "telemetry",
        "status",
        "flows",
        "stats",
        "events",
        "",
        "..",
        "255.255.255.255",
        "::ffff:10.1.0.1",
        "10.0.0.1",
    ]);
    let path = prop::collection::vec(seg, 0..6).prop_map(|s| format!("/v1/{}", s.join("/")));
    let text = any::<String>();
    let num = prop_oneof![
        any::<f64>().prop_map(|f| json!(f)),
        any::<i64>().prop_map(|i| json!(i)),
        any::<u64>().prop_map(|i| json!(i)),
    ];
    let addr = prop::sample::select(vec![
        "10.1.0.9",
        "255.255.255.255",
        "10.0.0.1",
        "::ffff:10.1.0.9",
        "127.0.0.1",
        "0.0.0.0",
        "fd00::9",
        "224.0.0.1",
        "not an ip",
    ]);
    let body = prop_oneof![
        Just(None),
        (addr.clone(), num.clone(), text, text).prop_map(|(a, w, k, v)| {
            Some(json!({"address": a, "weight": w, "labels": {k: v}}))
        }),
        (text, addr, num.clone()).prop_map(|(n, a, p)| {
            Some(json!({"vip": {"name": n, "address": a, "port": p, "protocol": "tcp"}}))
        }),
        num.clone().prop_map(|w| Some(json!({"weight": w}))),
        text.prop_map(|d| Some(json!({"deadline": d}))),
        (num.clone(), num).prop_map(|(q, k)| Some(json!({"queue_depth": q, "kv_cache": k}))),
        text.prop_map(|t| Some(json!(t))),
    ];
    let method = prop::sample::select(vec!["GET", "POST", "PUT", "DELETE", "PATCH"]);
    let mut runner = TestRunner::new(Config::default());
    runner
        .run(&(method, path, body), |(method, path, body)| {
            let bytes = body.map(|b| serde_json::to_vec(&b).unwrap());
            let (st, v) = c.send(method, &path, bytes.as_deref()).unwrap();
            prop_assert!(
                [200, 201, 204, 400, 403, 404, 405, 409, 413].contains(&st),
                "{method} {path}: {st} {v}"
            );
            if st >= 400 {
                let e = v["error"].as_str().unwrap_or_default();
                prop_assert!(!e.is_empty(), "{method} {path}: {v}");
                prop_assert!(!e.chars().any(char::is_control), "{method} {path}: {e:?}");
            }
            let state = srv.state();
            for vip in state.vips.values() {
                rules::vip_name(&vip.spec.name).unwrap();
                rules::vip_address(vip.spec.address).unwrap();
                for b in vip.backends.values() {
                    prop_assert!(rules::backend_address(b.spec.address, vip.spec.address).is_ok());
                    prop_assert!(rules::labels(&b.spec.labels).is_ok());
                }
            }
            Ok(())
        })
        .unwrap();
}

/// The API holds labels to the config file's bound, so neither path stores what the other
/// refuses.
#[test]
fn oversized_labels_are_refused() {
    let srv = TestServer::start();
    let c = srv.client();
    assert_eq!(c.request("POST", "/v1/vips", Some(&chat())).unwrap().0, 201);
    let before = srv.state();
    let long = json!({"address": "10.1.0.9", "labels": {"rack": "r".repeat(60_000)}});
    let many: serde_json::Map<String, Value> =
        (0..33).map(|i| (format!("k{i}"), json!("v"))).collect();
    let many = json!({"address": "10.1.0.9", "labels": many});
    for body in [long, many] {
        let (st, v) = c
            .request("POST", "/v1/vips/chat/backends", Some(&body))
            .unwrap();
        assert_eq!(st, 400, "{v}");
        assert!(v["error"].as_str().unwrap().len() < 300, "{v}");
    }
    assert_eq!(srv.state(), before);
}

#[test]
fn ipv6_backends_are_addressed_unbracketed_encoded_or_bracketed() {
    let srv = TestServer::start();
    let c = srv.client();
    let body = json!({
        "vip": {"name": "v6", "address": "fd00::10", "port": 0, "protocol": "udp"},
        "backends": [{"address": "fd00:1::1"}],
    });
    assert_eq!(c.request("POST", "/v1/vips", Some(&body)).unwrap().0, 201);
    for (i, path) in [
        "/v1/vips/v6/backends/fd00:1::1/weight",
        "/v1/vips/v6/backends/fd00%3A1%3A%3A1/weight",
        "/v1/vips/v6/backends/[fd00:1::1]/weight",
    ]
    .into_iter()
    .enumerate()
    {
        let (st, v) = c
            .request("PUT", path, Some(&json!({"weight": i + 1})))
            .unwrap();
        assert_eq!(
            (st, &v["address"], &v["weight"]),
            (200, &json!("fd00:1::1"), &json!(i + 1)),
            "{path}"
        );
    }
    let (st, _) = c
        .request("DELETE", "/v1/vips/v6/backends/fd00:1::1", None)
        .unwrap();
    assert_eq!(st, 204);
    assert!(srv.state().vip("v6").unwrap().backends.is_empty());
}

#[tokio::test]
async fn a_foreign_peer_is_refused_and_changes_nothing() {
    let api = Api {
        ctl: Arc::new(Mutex::new(controller())),
        info: Arc::new(info()),
        owner_uid: 4000,
        group_gid: 4001,
    };
    // pid 0 has no /proc entry: no supplementary groups.
    let stranger = Peer {
        uid: 4242,
        gid: 4242,
        pid: 0,
    };
    let req = Request::post("/v1/vips")
        .body(Full::new(Bytes::from(chat().to_string())))
        .unwrap();
    let resp = handle(&api, stranger, req).await;
    assert_eq!(resp.status(), 403);
    let body: Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .starts_with("uid 4242 may not use the admin API"),
        "{body}"
    );
    assert!(api.ctl.lock().await.state().vips.is_empty());

    // The same request from a member of the group is accepted.
    let member = Peer {
        gid: 4001,
        ..stranger
    };
    let req = Request::post("/v1/vips")
        .body(Full::new(Bytes::from(chat().to_string())))
        .unwrap();
    assert_eq!(handle(&api, member, req).await.status(), 201);
}

#[tokio::test]
async fn method_not_allowed_names_the_allowed_ones() {
    let api = Api {
        ctl: Arc::new(Mutex::new(controller())),
        info: Arc::new(info()),
        owner_uid: 0,
        group_gid: 0,
    };
    for (method, path, allow) in [
        (Method::DELETE, "/v1/status", "GET"),
        (Method::PUT, "/v1/vips/chat", "GET, DELETE"),
        (Method::GET, "/v1/vips/chat/backends/fd00::1/weight", "PUT"),
        (Method::GET, "/v1/vips/chat/backends/fd00::1/drain", "POST"),
    ] {
        let req = Request::builder()
            .method(method)
            .uri(path)
            .body(Full::<Bytes>::default())
            .unwrap();
        let resp = handle(&api, Peer::default(), req).await;
        assert_eq!(resp.status(), 405, "{path}");
        assert_eq!(resp.headers()[header::ALLOW], allow, "{path}");
    }
}

#[test]
fn path_segments_decode() {
    assert_eq!(decode_segment("fd00%3A%3a1").unwrap(), "fd00::1");
    assert_eq!(decode_segment("chat").unwrap(), "chat");
    assert!(decode_segment("%4").is_err());
    assert!(decode_segment("%+1").is_err());
    assert_eq!(
        path_addr("[fd00::1]").unwrap(),
        "fd00::1".parse::<IpAddr>().unwrap()
    );
    let seg = crate::client::path_segment("a/b c");
    assert_eq!(decode_segment(&seg).unwrap(), "a/b c");
}

/// A body declared larger than the limit gets 413 at once, not `100 Continue` and a wait
/// for megabytes; a small one still gets its `100 Continue` and is served.
#[test]
fn an_oversized_body_is_refused_before_100_continue() {
    use std::{
        io::{Read, Write},
        os::unix::net::UnixStream,
    };
    let srv = TestServer::start();
    let mut s = UnixStream::connect(&srv.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(
        b"POST /v1/vips HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 99000000\r\nExpect: 100-continue\r\n\r\n",
    )
    .unwrap();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer:?}");
    assert!(answer.contains("larger than 64 KiB"), "{answer:?}");

    let body = serde_json::to_vec(&chat()).unwrap();
    let mut s = UnixStream::connect(&srv.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let head = format!(
        "POST /v1/vips HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: \
         application/json\r\nContent-Length: {}\r\nExpect: 100-continue\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    let mut interim = [0u8; 25];
    s.read_exact(&mut interim).unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    s.write_all(&body).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
}

/// Changes sent at once by more clients than the admin listener's caps admit: each is
/// applied and audited, or its command fails saying so; none is lost in silence. With
/// `--retry` every one is applied.
#[test]
fn concurrent_changes_at_the_cap_are_applied_or_reported() {
    use clap::Parser;
    let limits = ListenerLimits {
        max_connections: 4,
        max_per_peer: 2,
        request_timeout: Duration::from_secs(2),
    };
    let srv = TestServer::start_with(limits);
    assert_eq!(
        srv.client()
            .request("POST", "/v1/vips", Some(&chat()))
            .unwrap()
            .0,
        201
    );
    let socket = srv.socket.display().to_string();
    let run = |args: Vec<String>| {
        let cli = crate::cli::Cli::try_parse_from(args).unwrap();
        crate::cli::execute(&cli, &mut Vec::new())
    };
    let audit = || std::fs::read_to_string(srv.dir.join("audit.jsonl")).unwrap_or_default();
    // (round, --retry, clients at once): many times the per-peer cap, without retries and
    // with them.
    for (round, retry, n) in [(1u8, "0", 30), (2, "10", 10)] {
        // Without retries one of the two slots is held by a slow client, so refusals are
        // all but certain.
        let slow = (retry == "0").then(|| {
            use std::io::Write;
            let mut s = std::os::unix::net::UnixStream::connect(&srv.socket).unwrap();
            s.write_all(b"GET /v1/status HTTP/1.1\r\n").unwrap();
            s
        });
        let addrs: Vec<String> = (1..=n).map(|i| format!("10.{round}.1.{i}")).collect();
        let results: Vec<_> = std::thread::scope(|sc| {
            let handles: Vec<_> = addrs
                .iter()
                .map(|a| {
                    let args = ["sluice", "--socket", &socket, "--retry", retry]
                        .into_iter()
                        .chain(["backend", "add", "chat", a])
                        .map(String::from)
                        .collect();
                    sc.spawn(move || run(args))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        drop(slow);
        let state = srv.state();
        let vip = state.vip("chat").unwrap();
        let log = audit();
        let mut refused = 0;
        for (a, r) in addrs.iter().zip(&results) {
            let applied = vip.backends.contains_key(&a.parse().unwrap());
            let audited = log.lines().any(|l| l.contains(&format!("\"{a}\"")));
            match r {
                Ok(()) => assert!(applied && audited, "{a}: succeeded but not applied"),
                Err(e) => {
                    refused += 1;
                    assert!(!applied && !audited, "{a}: applied but reported {e:#}");
                    let e = format!("{e:#}");
                    assert!(e.contains("at its connection cap"), "{a}: {e}");
                }
            }
        }
        if retry == "0" {
            assert!(refused > 0, "the caps were never reached");
        } else {
            assert_eq!(refused, 0, "with retries every change is applied");
        }
    }
}

#[test]
fn tenants_are_shown_and_replaced_whole_and_a_bad_list_changes_nothing() {
    let srv = TestServer::start();
    let c = srv.client();
    let (st, v) = c.request("POST", "/v1/vips", Some(&chat())).unwrap();
    assert_eq!(st, 201, "{v}");
    let (st, v) = c.request("GET", "/v1/tenants", None).unwrap();
    assert_eq!((st, v), (200, json!({"tenant": [], "tenants": []})));

    let list = json!({"tenant": [
        {"name": "acme", "prefixes": ["10.0.2.0/24"], "weight": 3, "max_sessions": 40},
        {"name": "default", "new_sessions_per_sec": 100}
    ]});
    let (st, v) = c.request("PUT", "/v1/tenants", Some(&list)).unwrap();
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["tenant"][0]["prefixes"], json!(["10.0.2.0/24"]));
    assert_eq!(v["tenant"][1]["burst"], 0);
    let chat = srv.state().vips["chat"].clone();
    let acme = lb_common::tenant_index(chat.id, 1);
    {
        let mut ctl = srv.ctl.blocking_lock();
        let b = chat.backends.values().next().unwrap().id;
        ctl.plane().tenant_flows = BTreeMap::from([((b, 1), 4)]);
        ctl.plane().tenant_stats = BTreeMap::from([(
            acme,
            lb_common::TenantStats {
                admitted: 12,
                refused_sessions: 2,
                refused_share: 1,
                refused_rate: 0,
            },
        )]);
    }
    let (st, v) = c.request("GET", "/v1/tenants", None).unwrap();
    assert_eq!(st, 200);
    let rows = v["tenants"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{v}");
    assert_eq!(rows[0]["tenant"], "default");
    assert_eq!(rows[0]["new_sessions_per_sec"], 100);
    assert_eq!(
        rows[1],
        json!({
            "tenant": "acme", "id": 1, "vip": "chat", "prefixes": ["10.0.2.0/24"],
            "weight": 3, "max_sessions": 40, "new_sessions_per_sec": 0, "burst": 0,
            "sessions": 4, "admitted": 12, "admitted_per_sec": 0.0,
            "refused": {"sessions": 2, "share": 1, "rate": 0}, "state": "ok"
        })
    );

    let before = srv.state();
    let bad = json!({"tenant": [
        {"name": "acme", "prefixes": ["10.0.2.1/24"]},
        {"name": "beta", "prefixes": ["10.0.3.0/24"], "burst": 5}
    ]});
    let (st, v) = c.request("PUT", "/v1/tenants", Some(&bad)).unwrap();
    assert_eq!(st, 400);
    let e = v["error"].as_str().unwrap();
    assert!(
        e.contains("tenant[0].prefixes[0]: \"10.0.2.1/24\" has bits set"),
        "{e}"
    );
    assert!(
        e.contains("tenant[1].burst: 5 is set without new_sessions_per_sec"),
        "{e}"
    );
    let (st, _) = c
        .request("PUT", "/v1/tenants", Some(&json!({"tenants": []})))
        .unwrap();
    assert_eq!(st, 400, "an unknown key is refused");
    assert_eq!(srv.state(), before, "nothing changed");
}
