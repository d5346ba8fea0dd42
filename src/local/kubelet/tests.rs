use super::*;

#[test]
fn gpu_nodes_are_read_from_node_count_and_memory() {
    let n: FakeNode = "node-a=2x40Gi".parse().unwrap();
    assert_eq!(
        (n.name.as_str(), n.gpus, n.gpu_memory),
        ("node-a", 2, 40 << 30)
    );
    let n: FakeNode = "b=3".parse().unwrap();
    assert_eq!((n.gpus, n.gpu_memory), (3, DEFAULT_GPU_MEMORY));
    for bad in ["node-a", "Node=1", "a=0", "a=2xlots", "a=x80Gi"] {
        assert!(bad.parse::<FakeNode>().is_err(), "{bad}");
    }
    assert_ne!(fake_gpu_uuid("a", 0), fake_gpu_uuid("a", 1));
    assert_eq!(fake_gpu_uuid("a", 0), fake_gpu_uuid("a", 0), "stable");
    assert!(fake_gpu_uuid("a", 0).starts_with("GPU-"));
}

#[tokio::test]
async fn a_server_that_cannot_listen_is_an_error_and_a_taken_address_is_skipped() {
    let taken = tokio::net::TcpListener::bind("127.3.0.1:0").await.unwrap();
    let port = taken.local_addr().unwrap().port();
    let id = Identity {
        model: "m".into(),
        pod: "p".into(),
    };
    let ip = |n: u8| Ipv4Addr::new(127, 3, 0, n);
    let e = listen_on_one_of(
        [ip(1)].into_iter(),
        port,
        id.clone(),
        Duration::ZERO,
        Default::default(),
    )
    .await
    .unwrap_err();
    assert!(e.contains("cannot listen on 127.3.0.1"), "{e}");
    let server = listen_on_one_of(
        [ip(1), ip(2)].into_iter(),
        port,
        id,
        Duration::ZERO,
        Default::default(),
    )
    .await
    .unwrap();
    assert_eq!(server.addr, SocketAddr::from((ip(2), port)));
}
