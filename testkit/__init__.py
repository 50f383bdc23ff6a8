"""Test support shared by ``tests/`` and ``bench/`` (never imported by the product packages).

* ``fake_engine`` (+ ``fake_base``, ``fake_wire``, ``fake_protocols``): protocol fake engines that
  speak vLLM Mooncake, vLLM NIXL and SGLang PD on the wire (``python -m testkit.fake_engine``);
* ``fake_cluster``: the router in front of fake engines (``FakeCluster``, ``settings_for``);
* ``worker_cluster``: the router in front of simulated ``pd-worker`` engines, in-process;
* ``servers``: real uvicorn servers on 127.0.0.1 (threads, the test's loop, subprocesses);
* ``etcd_server``: a real etcd on loopback; ``polling``: ``wait_until`` with a deadline.
"""
