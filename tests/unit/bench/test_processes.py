"""The bench's view of Serve replica processes."""

from cluster.bench.processes import replica_of


def test_a_replica_running_a_call_is_the_same_replica():
    """Ray appends the method it runs to a replica's title: the adversarial run counted the render
    replica as restarted because its title had changed between two looks."""
    idle = replica_of("ray::ServeReplica:adversarial:RenderActor")
    busy = replica_of("ray::ServeReplica:adversarial:RenderActor.handle_request_with_rejection")
    assert idle == busy == ("adversarial", "RenderActor")
    assert replica_of("ray::ServeController") is None and replica_of("python -m pytest") is None
