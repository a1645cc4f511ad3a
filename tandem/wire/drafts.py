"""The one codec of a round's drafts: tandem.sampling.draft_tree.DraftTree <-> the wire's DraftTree message.

A chain goes without parents (the common case costs nothing more than its tokens); a message without parents is read
as a chain. Scores (a drafter's confidence in each node) travel only when the drafter gives them. Reading does not
check: the receiver calls DraftTree.fault with its own limits and vocabulary.
"""

from __future__ import annotations

from tandem.sampling.draft_tree import DraftTree
from tandem.wire import common_pb2


def tree_to_proto(tree: DraftTree) -> common_pb2.DraftTree:
    return common_pb2.DraftTree(tokens=tree.tokens, parents=tree.wire_parents(), scores=tree.scores)


def tree_from_proto(message: common_pb2.DraftTree) -> DraftTree:
    return DraftTree.of(list(message.tokens), list(message.parents), list(message.scores))
