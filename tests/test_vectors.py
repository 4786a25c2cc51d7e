"""Vector index on real Chroma, embedded and a server: filters, upserts, deletes, persistence, threads."""

from __future__ import annotations

import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from memory.index.vectors import VectorIndex, where_clause
from tests.support.servers import ChromaServer

DIM = 384
Vectors = npt.NDArray[np.float32]


def unit_vectors(rng: np.random.Generator, n: int) -> Vectors:
    vectors = rng.normal(size=(n, DIM)).astype(np.float32)
    normalised: Vectors = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    return normalised


def near(rng: np.random.Generator, vector: Vectors, noise: float) -> Vectors:
    moved = vector + rng.normal(scale=noise, size=DIM).astype(np.float32)
    normalised: Vectors = (moved / np.linalg.norm(moved)).astype(np.float32)
    return normalised


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


@pytest.fixture(
    params=[("embedded", 0), ("embedded", 64 << 20), ("server", 0), ("server", 64 << 20)],
    ids=["chroma-filter", "user-copies", "server-filter", "server-user-copies"],
)
def index(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[VectorIndex]:
    """Every test runs against both query paths (Chroma's filter and the per-user copies),
    on embedded Chroma and on a Chroma server."""
    where, cache_bytes = request.param
    if where == "server":
        server: ChromaServer = request.getfixturevalue("chroma_server")
        # A collection per test keeps the tests apart on the one server.
        opened = VectorIndex.connect(server.url, f"t-{uuid.uuid4().hex}", cache_bytes=cache_bytes)
    else:
        opened = VectorIndex.open(tmp_path / "vectors", cache_bytes=cache_bytes)
    yield opened
    opened.close()


def same_chroma(index: VectorIndex) -> VectorIndex:
    """Another client of the index's Chroma and collection, as another process would have."""
    if index.path is not None:
        return VectorIndex.open(index.path, index.name)
    return VectorIndex.connect(str(index.url), index.name)


def test_query_returns_cosine_similarity_best_first(
    index: VectorIndex, rng: np.random.Generator
) -> None:
    vectors = unit_vectors(rng, 20)
    index.add([f"v{i}" for i in range(20)], vectors, [{"user_id": "a"}] * 20)

    hits = index.query(vectors[3], k=5, where={"user_id": "a"})

    assert hits[0][0] == "v3"
    assert hits[0][1] == pytest.approx(1.0, abs=1e-5)
    similarities = [score for _, score in hits]
    assert similarities == sorted(similarities, reverse=True)
    expected = {f"v{i}": float(vectors[i] @ vectors[3]) for i in range(20)}
    for id_, score in hits:
        assert score == pytest.approx(expected[id_], abs=1e-4)
    assert len(index.query(vectors[3], k=50, where={"user_id": "a"})) == 20


def test_filters_isolate_users_and_sessions(index: VectorIndex, rng: np.random.Generator) -> None:
    query = unit_vectors(rng, 1)[0]
    # B's vectors sit right on the query; A's are far away.
    b_vectors = np.stack([near(rng, query, 0.001) for _ in range(30)])
    a_vectors = unit_vectors(rng, 30)
    index.add(
        [f"b{i}" for i in range(30)],
        b_vectors,
        [{"user_id": "B", "session_id": "s1"}] * 30,
    )
    index.add(
        [f"a{i}" for i in range(30)],
        a_vectors,
        [{"user_id": "A", "session_id": f"s{i % 2}"} for i in range(30)],
    )

    for_a = index.query(query, k=10, where={"user_id": "A"})
    assert len(for_a) == 10
    assert all(id_.startswith("a") for id_, _ in for_a)

    a_session = index.query(query, k=50, where={"user_id": "A", "session_id": "s1"})
    assert sorted(id_ for id_, _ in a_session) == sorted(f"a{i}" for i in range(1, 30, 2))
    assert index.query(query, k=5, where={"user_id": "nobody"}) == []


def test_upsert_is_idempotent_and_replaces(index: VectorIndex, rng: np.random.Generator) -> None:
    vectors = unit_vectors(rng, 5)
    ids = [f"v{i}" for i in range(5)]
    index.add(ids, vectors, [{"user_id": "a", "turn_id": i} for i in range(5)])
    index.add(ids, vectors, [{"user_id": "a", "turn_id": i} for i in range(5)])
    assert index.count() == 5

    index.add(["v0"], vectors[4:5], [{"user_id": "b", "pinned": True}])
    assert index.count() == 5
    assert [id_ for id_, _ in index.query(vectors[0], k=5, where={"user_id": "b"})] == ["v0"]
    assert index.query(vectors[4], k=1, where={"user_id": "b"})[0][1] == pytest.approx(
        1.0, abs=1e-5
    )


def test_delete_by_where_and_ids(index: VectorIndex, rng: np.random.Generator) -> None:
    vectors = unit_vectors(rng, 12)
    metas = [{"user_id": f"u{i % 2}", "session_id": f"s{i % 3}"} for i in range(12)]
    index.add([f"v{i}" for i in range(12)], vectors, metas)

    index.delete(where={"user_id": "u0", "session_id": "s0"})  # v0, v6
    index.delete(ids=["v1"])
    index.delete(ids=[])

    assert index.count() == 9
    left = {id_ for id_, _ in index.query(vectors[0], k=20, where={"user_id": "u0"})}
    assert left == {"v2", "v4", "v8", "v10"}
    index.delete(where={"user_id": "u1"})
    assert index.count() == 4
    with pytest.raises(ValueError, match="ids or where"):
        index.delete()


def test_add_checks_lengths_and_ignores_empty(index: VectorIndex) -> None:
    index.add([], np.zeros((0, DIM), dtype=np.float32), [])
    assert index.count() == 0
    with pytest.raises(ValueError, match="as many"):
        index.add(["a", "b"], np.zeros((1, DIM), dtype=np.float32), [{"user_id": "a"}] * 2)


def test_persists_across_reopen(tmp_path: Path, rng: np.random.Generator) -> None:
    vectors = unit_vectors(rng, 8)
    first = VectorIndex.open(tmp_path / "vectors")
    first.add([f"v{i}" for i in range(8)], vectors, [{"user_id": "a"}] * 8)
    first.close()

    second = VectorIndex.open(tmp_path / "vectors")
    try:
        assert second.count() == 8
        hit, similarity = second.query(vectors[5], k=1, where={"user_id": "a"})[0]
        assert hit == "v5"
        assert similarity == pytest.approx(1.0, abs=1e-5)  # still cosine space
    finally:
        second.close()


def test_where_clause() -> None:
    assert where_clause({}) is None
    assert where_clause({"user_id": "u"}) == {"user_id": {"$eq": "u"}}
    assert where_clause({"user_id": "u", "session_id": "s"}) == {
        "$and": [{"user_id": {"$eq": "u"}}, {"session_id": {"$eq": "s"}}]
    }


def test_concurrent_threads(index: VectorIndex) -> None:
    errors: list[str] = []

    def writer(user: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for batch in range(15):
                ids = [f"{user}-{batch}-{i}" for i in range(32)]
                index.add(ids, unit_vectors(rng, 32), [{"user_id": user}] * 32)
                if batch % 5 == 4:
                    index.delete(ids=ids[:4])
        except Exception as exc:  # collected so the main thread can report it
            errors.append(repr(exc))

    def reader() -> None:
        rng = np.random.default_rng(99)
        try:
            for _ in range(60):
                for id_, _ in index.query(unit_vectors(rng, 1)[0], k=10, where={"user_id": "A"}):
                    if not id_.startswith("A-"):
                        errors.append(f"leaked {id_}")
        except Exception as exc:
            errors.append(repr(exc))

    threads = [
        threading.Thread(target=writer, args=("A", 1)),
        threading.Thread(target=writer, args=("B", 2)),
        threading.Thread(target=reader),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert index.count() == 2 * (15 * 32 - 3 * 4)


def test_user_copies_answer_like_chroma(tmp_path: Path, rng: np.random.Generator) -> None:
    """The same data, queried through both paths, gives the same ids and similarities."""
    vectors = unit_vectors(rng, 300)
    metas = [{"user_id": f"u{i % 3}", "session_id": f"s{i % 4}", "source": "turn"}
             for i in range(300)]
    chroma = VectorIndex.open(tmp_path / "a")
    copies = VectorIndex.open(tmp_path / "b", cache_bytes=64 << 20)
    try:
        for index in (chroma, copies):
            index.add([f"v{i}" for i in range(300)], vectors, metas)
        for probe in unit_vectors(rng, 5):
            for where in ({"user_id": "u1"}, {"user_id": "u2", "session_id": "s2"},
                          {"user_id": "u0", "source": "fact"}):
                expected = chroma.query(probe, k=15, where=where)
                got = copies.query(probe, k=15, where=where)
                assert [i for i, _ in got] == [i for i, _ in expected]
                assert [s for _, s in got] == pytest.approx([s for _, s in expected], abs=1e-5)
    finally:
        chroma.close()
        copies.close()


def test_user_copies_follow_writes_and_deletes(tmp_path: Path, rng: np.random.Generator) -> None:
    index = VectorIndex.open(tmp_path / "vectors", cache_bytes=64 << 20)
    try:
        vectors = unit_vectors(rng, 6)
        index.add(["a0", "a1"], vectors[:2], [{"user_id": "A"}] * 2)
        assert [i for i, _ in index.query(vectors[0], k=5, where={"user_id": "A"})] == ["a0", "a1"]
        # Written after A's copy was loaded: visible at once.
        index.add(["a2"], vectors[2:3], [{"user_id": "A", "session_id": "s"}])
        assert index.query(vectors[2], k=1, where={"user_id": "A"})[0][0] == "a2"
        assert index.query(vectors[2], k=5, where={"user_id": "A", "session_id": "s"})[0][0] == "a2"
        # Upserting an id under another user moves it: A no longer sees it.
        index.add(["a1"], vectors[3:4], [{"user_id": "B"}])
        assert {i for i, _ in index.query(vectors[3], k=5, where={"user_id": "A"})} == {"a0", "a2"}
        assert [i for i, _ in index.query(vectors[3], k=5, where={"user_id": "B"})] == ["a1"]
        index.delete(ids=["a0"])
        assert [i for i, _ in index.query(vectors[0], k=5, where={"user_id": "A"})] == ["a2"]
        index.delete(where={"user_id": "A", "session_id": "s"})
        assert index.query(vectors[0], k=5, where={"user_id": "A"}) == []
    finally:
        index.close()


def test_user_copies_stay_within_their_memory(tmp_path: Path, rng: np.random.Generator) -> None:
    one_user = 400 * DIM * 4  # 400 vectors of float32, before metadata
    index = VectorIndex.open(tmp_path / "vectors", cache_bytes=int(2.5 * one_user))
    try:
        for user in range(6):
            index.add([f"{user}-{i}" for i in range(400)], unit_vectors(rng, 400),
                      [{"user_id": f"u{user}"}] * 400)
        for user in range(6):
            hits = index.query(unit_vectors(rng, 1)[0], k=3, where={"user_id": f"u{user}"})
            assert all(i.startswith(f"{user}-") for i, _ in hits) and len(hits) == 3
        held = index._cache._users  # the cache's own bookkeeping: what is loaded
        assert 1 <= len(held) <= 2
        assert list(held)[-1] == "u5"  # the most recent user stays
        assert sum(v.nbytes for v in held.values()) <= int(2.5 * one_user)
    finally:
        index.close()


def test_a_lost_collection_is_created_again_and_the_owner_told(
    index: VectorIndex, rng: np.random.Generator
) -> None:
    vectors = unit_vectors(rng, 4)
    index.add(["a0", "a1"], vectors[:2], [{"user_id": "A"}] * 2)
    assert [i for i, _ in index.query(vectors[0], k=5, where={"user_id": "A"})] == ["a0", "a1"]
    told: list[str] = []
    index.on_lost = told.append
    other = same_chroma(index)
    other._client.delete_collection(index.name)
    other.close()

    index.add(["a2"], vectors[2:3], [{"user_id": "A"}])  # runs again on the new collection
    assert told == ["the collection was deleted"]
    assert index.count() == 1
    assert [i for i, _ in index.query(vectors[2], k=5, where={"user_id": "A"})] == ["a2"]
    # A failure that is not a loss is the caller's to see, and nothing is created again.
    with pytest.raises(ValueError, match="metadata value"):
        index.add(["a3"], vectors[3:4], [{"user_id": {"not": "a scalar"}}])  # type: ignore[dict-item]
    assert told == ["the collection was deleted"] and index.count() == 1


def test_user_copies_are_kept_in_files_across_restarts(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    vectors = unit_vectors(rng, 40)
    path = tmp_path / "vectors"
    index = VectorIndex.open(path, cache_bytes=64 << 20)
    try:
        index.add([f"a{i}" for i in range(20)], vectors[:20], [{"user_id": "A", "source": "turn"}] * 20)
        index.add([f"b{i}" for i in range(10)], vectors[20:30], [{"user_id": "B"}] * 10)
        index.query(vectors[0], k=3, where={"user_id": "A"})  # loaded from Chroma, then saved
        folder = tmp_path / "vector-copies" / "memory"
        assert len(list(folder.glob("*.vectors"))) == 1
        # Changed after it was saved: the file goes at once, the copy in memory follows.
        index.add(["a20"], vectors[30:31], [{"user_id": "A", "source": "fact"}])
        assert list(folder.glob("*.vectors")) == []
        index.save_copies()  # what the engine's maintenance does every hour
        assert len(list(folder.glob("*.vectors"))) == 1
        index.add(["a21"], vectors[31:32], [{"user_id": "A", "source": "fact"}])
        index.delete(ids=["a3"])  # drops the copy in memory too: reloaded below
        assert index.query(vectors[30], k=1, where={"user_id": "A"})[0][0] == "a20"
        index.add(["a22"], vectors[32:33], [{"user_id": "A", "source": "fact"}])
    finally:
        index.close()  # saves A's copy, changed since its reload

    files = list((tmp_path / "vector-copies" / "memory").glob("*.vectors"))
    assert len(files) == 1  # A's; B's copy was never loaded
    saved = files[0].stat().st_mtime_ns
    index, chroma = VectorIndex.open(path, cache_bytes=64 << 20), VectorIndex.open(path)
    try:
        for probe in [*vectors[:4], *vectors[30:33]]:
            for where in ({"user_id": "A"}, {"user_id": "A", "source": "turn"}):
                got, expected = index.query(probe, k=8, where=where), chroma.query(probe, k=8, where=where)
                assert [i for i, _ in got] == [i for i, _ in expected]
                assert [s for _, s in got] == pytest.approx([s for _, s in expected], abs=1e-5)
        assert files[0].stat().st_mtime_ns == saved  # read from the file, not from Chroma
        # A write through an index without copies in memory still discards the file.
        chroma.add(["a23"], vectors[33:34], [{"user_id": "A"}])
        assert not files[0].exists()
    finally:
        index.close()
        chroma.close()
    index = VectorIndex.open(path, cache_bytes=64 << 20)
    try:
        assert index.query(vectors[33], k=1, where={"user_id": "A"})[0][0] == "a23"
    finally:
        index.close()


def test_a_copy_file_of_another_collection_or_damaged_is_not_used(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    vectors = unit_vectors(rng, 5)
    path = tmp_path / "vectors"
    index = VectorIndex.open(path, cache_bytes=64 << 20)
    index.add([f"a{i}" for i in range(5)], vectors, [{"user_id": "A"}] * 5)
    index.query(vectors[0], k=1, where={"user_id": "A"})
    index.close()
    [copy] = (tmp_path / "vector-copies" / "memory").glob("*.vectors")
    foreign = copy.read_bytes()
    # The collection is created anew (its directory gone): the old file must not answer.
    shutil.rmtree(path)
    index = VectorIndex.open(path, cache_bytes=64 << 20)
    try:
        index.add(["n0"], vectors[:1], [{"user_id": "A"}])
        copy.write_bytes(foreign)  # an old file put back by hand
        assert [i for i, _ in index.query(vectors[0], k=5, where={"user_id": "A"})] == ["n0"]
    finally:
        index.close()
    copy.write_bytes(b"garbage")
    index = VectorIndex.open(path, cache_bytes=64 << 20)
    try:
        assert [i for i, _ in index.query(vectors[0], k=5, where={"user_id": "A"})] == ["n0"]
    finally:
        index.close()
