"""trainer/membership.py: the change line between two starts of a run, hand-written cases;
the layout error's world-change note; nodes.json written whole and read back."""
from trainer.membership import Membership, change_line, explain_layout_error, read, write

FOUR = Membership(4, {"h:10": [0, 1], "h:20": [2, 3]})
TWO = Membership(2, {"h:10": [0, 1]})


def test_change_lines():
    assert change_line(None, FOUR, 0) is None  # a new run
    assert change_line(FOUR, Membership(4, {"h:20": [2, 3], "h:10": [0, 1]}), 30) is None
    assert change_line(FOUR, TWO, 40) == ("nodes changed: node h:20 (was ranks 2-3) left; world 4 -> 2 "
                                          "processes on 1 node(s); resuming from step 40")
    regained = Membership(4, {"h:10": [0, 1], "g:7": [2, 3]})
    assert change_line(TWO, regained, 113) == ("nodes changed: node g:7 (now ranks 2-3) joined; world 2 -> 4 "
                                               "processes on 2 node(s); resuming from step 113")
    swapped = Membership(3, {"h:10": [0], "a:1": [1], "b:2": [2]})
    assert change_line(FOUR, swapped, 0) == (
        "nodes changed: node h:20 (was ranks 2-3) left; nodes a:1 (now rank 1), b:2 (now rank 2) "
        "joined; world 4 -> 3 processes on 3 node(s); starting from step 0 (no checkpoint)")


def test_layout_error_names_the_world_change():
    msg = "parallel.ep=2 must divide dp*tp = 1*1 = 1 (...); lower ep or raise dp"
    assert explain_layout_error(msg, None, 1) == msg
    assert explain_layout_error(msg, Membership(1, {"h:1": [0]}), 1) == msg
    out = explain_layout_error(msg, FOUR, 1)
    assert out.startswith(msg) and "last trained on 4 processes and now has 1" in out
    assert "parallel.dp=-1" in out and "\n" not in out


def test_nodes_file_round_trip(tmp_path):
    assert read(tmp_path) is None
    write(tmp_path, FOUR, 30)
    assert read(tmp_path) == FOUR and not list(tmp_path.glob("*.tmp"))
    (tmp_path / "nodes.json").write_text("{broken")
    assert read(tmp_path) is None


def test_shared_store_note_only_for_several_nodes_on_the_shared_store(monkeypatch):
    from trainer.membership import shared_store_warning
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    assert shared_store_warning() is None  # one node: nothing to rejoin
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shared_store_warning()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert shared_store_warning() is None
