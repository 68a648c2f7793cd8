"""Linear-time replacements for numba-cuda's passes that go quadratic on kernelgen's kernels (issue 27).

kernelgen.numba_speedups installs them (version- and source-guarded, like its other patches); they compute exactly
what numba-cuda's functions compute.

* analysis.compute_live_map (run by every PostProcessor: ~9 times per compile) iterates two round-robin fixed
  points over all blocks until nothing changes.  Its first one materialises, per block, the set of every variable
  defined or used on any path to it: blocks x variables, and as many sweeps as the CFG is deep.  Every `and` of a
  generated predicate is a branch, so a TF32 wgmma backward-weight kernel has ~1000 blocks and thousands of
  names.  (With all five replacements that kernel's front end, issue 27's, went 177 s -> 21 s.)  The
  replacement answers "v is defined or used on a path to p" from bit sets over blocks
  (the blocks that reach p; the blocks that define or use v) and propagates liveness along the CFG's edges with a
  worklist of the variables each block newly gained: work proportional to the live sets' sizes.
* ssa._run_ssa rewrites every block once per variable assigned more than once (a fresh-names walk and a
  reaching-definitions walk: violators x statements handler calls, and a scan of the block to place each use).
  The replacement hands each violator's two handlers only the statements that mention it (an index of positions
  built once): on any other statement both return it unchanged and record nothing, so the blocks, names and phis
  come out the same, in the same order.
* analysis.compute_dead_maps ends by checking that its maps cover every live variable: unions folded with
  reduce(operator.or_, ...), each step a new set: blocks x variables.  The replacement takes the unions in one
  call each; the maps are built as numba's builds them.
* typed_passes.PreLowerStripPhis._strip_phi_nodes places each phi's incoming value after the last assignment to
  it in the incoming block: for every one, a scan of the block comparing targets with IR equality (a dict
  comparison per Var) and a list.index (an Assign comparison per statement).  The replacement still scans the
  block per incoming value, but compares names first (equal Vars have equal names) and finds the index among
  those assignments only: ~10x less on Winograd kernels.
* ir_utils.fixup_var_define_in_scope (InlineClosureCallPass's end) checks every referenced variable against every
  block's scope: blocks x variables, though the blocks share one scope.  The replacement checks each scope once.
"""
from __future__ import annotations

import logging
from collections import defaultdict, deque


# --- liveness -----------------------------------------------------------------------------------------------------

def _ancestors(cfg, var_def_map):
    """{label: bit set of the blocks whose (def | use) numba's def_reach carries to it}: itself and, transitively,
    its predecessors, through blocks of var_def_map only (def_reach propagates from those only); plus each
    label's bit."""
    bit = {}
    anc = {}

    def bit_of(label):
        b = bit.get(label)
        if b is None:
            b = bit[label] = 1 << len(bit)
            anc[label] = b
        return b

    for label in var_def_map:
        bit_of(label)
    work = deque(var_def_map)
    queued = set(work)
    while work:
        p = work.popleft()
        queued.discard(p)
        mine = anc[p]
        for s, _ in cfg.successors(p):
            bit_of(s)
            grown = anc[s] | mine
            if grown != anc[s]:
                anc[s] = grown
                if s in var_def_map and s not in queued:
                    work.append(s)
                    queued.add(s)
    return bit, anc


def compute_live_map(cfg, blocks, var_use_map, var_def_map):
    """numba-cuda's analysis.compute_live_map, without materialising def_reach: the same least fixed point,
    live[p] = use[p] | U_{s succ of p} ((live[s] & reach[p]) - def[p]), where reach[p] is what numba's def_reach
    builds: every variable defined or used in a block of var_def_map with a path to p through such blocks.
    v in reach[p] is answered as "a block defining or using v is among p's ancestors" (two bit sets over blocks),
    and each block's newly live variables are pushed to its predecessors once."""
    bit, anc = _ancestors(cfg, var_def_map)
    mentions = defaultdict(int)  # variable -> bit set of the var_def_map blocks defining or using it
    for label, defs in var_def_map.items():
        b = bit[label]
        for name in defs:
            mentions[name] |= b
        for name in var_use_map[label]:
            mentions[name] |= b
    live_map = {label: set(var_use_map[label]) for label in blocks}
    work = deque((label, set(live)) for label, live in live_map.items() if live)
    while work:
        s, gained = work.popleft()
        for p, _ in cfg.predecessors(s):
            live = live_map[p]
            new = gained - live
            if not new:
                continue
            new -= var_def_map[p]
            reaching = anc.get(p, 0)
            new = {name for name in new if mentions.get(name, 0) & reaching}
            if new:
                live |= new
                work.append((p, new))
    return live_map


def compute_dead_maps(cfg, blocks, live_map, var_def_map):
    """numba-cuda's analysis.compute_dead_maps with its final coverage check's unions taken by set().union(*...)
    instead of reduce(operator.or_, ...) (which copies the growing union at every block): the same sets, and the
    same maps, built by numba's code as it is."""
    from numba.cuda.core import analysis

    escaping_dead_map = defaultdict(set)
    internal_dead_map = defaultdict(set)
    exit_dead_map = defaultdict(set)
    for offset, ir_block in blocks.items():
        cur_live_set = live_map[offset] | var_def_map[offset]
        outgoing_live_map = dict((out_blk, live_map[out_blk]) for out_blk, _data in cfg.successors(offset))
        terminator_liveset = set(v.name for v in ir_block.terminator.list_vars())
        combined_liveset = set().union(*outgoing_live_map.values())
        combined_liveset |= terminator_liveset
        internal_set = cur_live_set - combined_liveset
        internal_dead_map[offset] = internal_set
        escaping_live_set = cur_live_set - internal_set
        for out_blk, new_live_set in outgoing_live_map.items():
            new_live_set = new_live_set | var_def_map[out_blk]
            escaping_dead_map[out_blk] |= escaping_live_set - new_live_set
        if not outgoing_live_map:
            exit_dead_map[offset] = terminator_liveset
    all_vars = set().union(*live_map.values())
    dead_vars = set().union(*internal_dead_map.values(), *escaping_dead_map.values(), *exit_dead_map.values())
    missing_vars = all_vars - dead_vars
    if missing_vars and cfg.exit_points():  # (no exit points: numba cannot verify, and does not)
        raise RuntimeError("liveness info missing for vars: {0}".format(missing_vars))
    combined = dict((k, internal_dead_map[k] | escaping_dead_map[k]) for k in blocks)
    return analysis._dead_maps_result(internal=internal_dead_map, escaping=escaping_dead_map, combined=combined)


# --- phis out -----------------------------------------------------------------------------------------------------

def _insert_at(body, rhs):
    """Where numba's _strip_phi_nodes inserts `target = rhs` in `body`: after body.index(last), last being the last
    Assign whose target == rhs (None: there is none, and it prepends).  list.index returns the first statement
    that is `last` or == it; a statement == an Assign is an Assign of the same type with an equal target, so one of
    those assignments.  A Var == rhs only if their names are equal (IR equality compares the attributes but loc
    and scope): names are compared first, IR equality only where they match."""
    from numba.cuda.core import ir

    name = rhs.name if isinstance(rhs, ir.var_types) else None
    found = []
    for i, stmt in enumerate(body):
        if isinstance(stmt, ir.assign_types):
            target = stmt.target
            if (name is None or getattr(target, "name", None) == name) and target == rhs:
                found.append((i, stmt))
    if not found:
        return None
    last = found[-1][1]
    return next(i for i, stmt in found if stmt is last or stmt == last) + 1


def strip_phi_nodes(self, func_ir):
    """numba-cuda's PreLowerStripPhis._strip_phi_nodes, the insertion point found by _insert_at."""
    from copy import copy

    from numba.cuda.core import ir

    exporters = defaultdict(list)
    phis = set()
    for block in func_ir.blocks.values():
        for assign in block.find_insts(ir.assign_types):
            if isinstance(assign.value, ir.expr_types) and assign.value.op == "phi":
                phis.add(assign)
                phi = assign.value
                for ib, iv in zip(phi.incoming_blocks, phi.incoming_values):
                    exporters[ib].append((assign.target, iv))
    newblocks = {}
    for label, block in func_ir.blocks.items():
        newblk = copy(block)
        newblocks[label] = newblk
        newblk.body = [stmt for stmt in block.body if stmt not in phis]
        term_loc = block.terminator.loc if block.is_terminated else block.loc
        for target, rhs in exporters[label]:
            if rhs is ir.UNDEFINED:
                rhs = ir.Expr.null(loc=func_ir.loc)
            at = _insert_at(newblk.body, rhs)
            if at is not None:
                newblk.body.insert(at, ir.Assign(target=target, value=rhs, loc=rhs.loc))
            else:
                newblk.prepend(ir.Assign(target=target, value=rhs, loc=term_loc))
    func_ir.blocks = newblocks
    return func_ir


# --- scopes -------------------------------------------------------------------------------------------------------

def fixup_var_define_in_scope(blocks):
    """numba-cuda's ir_utils.fixup_var_define_in_scope, each distinct scope visited once: a scope's second visit
    (another block of it) defines nothing, as its first defined every name missing from it, and nothing else changes
    in between.  The variables are gathered, and defined, in the original's order."""
    used_var = {}
    for blk in blocks.values():
        for inst in blk.body:
            for var in inst.list_vars():
                used_var[var] = inst
    done = set()
    for blk in blocks.values():
        scope = blk.scope
        if id(scope) in done:
            continue
        done.add(id(scope))
        localvars = scope.localvars
        for var in used_var:
            if var.name not in localvars:
                localvars.define(var.name, var)


# --- SSA reconstruction -------------------------------------------------------------------------------------------

def _mentions(blocks, names):
    """{name: {label: positions of the block's statements that mention it (as target or use)}}, for the given
    names; labels in the blocks' order, positions ascending."""
    where = defaultdict(dict)
    for label, block in blocks.items():
        for i, stmt in enumerate(block.body):
            for name in {var.name for var in stmt.list_vars()}.intersection(names):
                where[name].setdefault(label, []).append(i)
    return where


def _stmt_index(self, defstmt, block, stop=-1):
    """ssa._FixSSAVars._stmt_index from the positions _rewrite_some knows (self._kernelgen_at: id of each statement
    it hands the handler -> its position).  Every statement asked for is one of those (the statement being fixed,
    or one of the block's definitions of the variable), or a phi, which is in no block body (numba's scan then
    finds nothing).  Numba's result: the first position if below `stop` (it scans range(len(body))[:stop]: -1
    means all but the terminator), else len(body)."""
    n = len(block.body)
    i = self._kernelgen_at.get(id(defstmt))
    return i if i is not None and i < len(range(n)[:stop]) else n


def _rewrite_some(work, states, handler, sites, shift):
    """ssa._run_block_rewrite, in place on `work` (label -> block), with the handler run only on the statements at
    `sites` ({label: positions in the block before SSA}; `shift`: how many phis each block has gained since, all
    at its top).  Each block with a site is replaced by a new one, as numba replaces every block."""
    from numba.cuda.core import ir

    for label, positions in sites.items():
        blk = work[label]
        states["label"] = label
        states["block"] = blk
        body = list(blk.body)
        at = [pos + shift[label] for pos in positions]
        handler._kernelgen_at = {}
        for i in at:
            handler._kernelgen_at.setdefault(id(body[i]), i)
        for i in at:
            stmt = body[i]
            if isinstance(stmt, ir.assign_types):
                ret = handler.on_assign(states, stmt)
            else:
                ret = handler.on_other(states, stmt)
            assert ret is not None
            body[i] = ret
        newblk = work[label] = ir.Block(scope=blk.scope, loc=blk.loc)
        newblk.body = body


def _fix_violator(work, varname, cfg, df_plus, cache_list_vars, sites, shift):
    """ssa._fresh_vars then ssa._fix_ssa_vars for one violator, on the statements at `sites` only."""
    from numba.cuda.core import ssa

    states = ssa._make_states(work)
    states["varname"] = varname
    states["defmap"] = defmap = defaultdict(list)
    _rewrite_some(work, states, ssa._FreshVarHandler(), sites, shift)
    states = ssa._make_states(work)
    states["varname"] = varname
    states["defmap"] = defmap
    states["phimap"] = phimap = defaultdict(list)
    states["cfg"] = cfg
    states["phi_locations"] = ssa._compute_phi_locations(df_plus, defmap)
    handler = ssa._FixSSAVars(cache_list_vars)
    handler._stmt_index = _stmt_index.__get__(handler)  # (this handler's only: numba's class keeps its own)
    _rewrite_some(work, states, handler, sites, shift)
    for label, philist in phimap.items():
        curblk = work[label]
        curblk.body = philist + curblk.body
        shift[label] += len(philist)


def run_ssa(blocks):
    """numba-cuda's ssa._run_ssa, each violator's two rewrites restricted to the statements that mention it.  A
    violator's rewrite replaces statements one for one and renames only that variable (to fresh names, never a
    violator), and its phis go to the top of blocks: the index of positions, built once, stays true for the
    violators not yet processed, shifted by the phis placed since.  The blocks returned are new ones, as numba's
    (the input's are not changed)."""
    from numba.cuda.core import errors, ir, ssa

    if not blocks:
        return {}
    cfg = ssa.compute_cfg_from_blocks(blocks)
    df_plus = ssa._iterated_domfronts(cfg)
    violators = ssa._find_defs_violators(blocks, cfg)
    cache_list_vars = ssa._CacheListVars()
    where = _mentions(blocks, violators)
    work = {}
    for label, blk in blocks.items():
        work[label] = ir.Block(scope=blk.scope, loc=blk.loc)
        work[label].body = list(blk.body)
    shift = defaultdict(int)
    for varname in violators:
        _fix_violator(work, varname, cfg, df_plus, cache_list_vars, where.get(varname, {}), shift)
    if ssa.compute_cfg_from_blocks(work) != cfg:
        raise errors.CompilerError("CFG mutated in SSA pass")
    return work


class RunSSA:
    """What kernelgen.numba_speedups puts in place of ssa._run_ssa (made from numba's): run_ssa, or numba's own
    while numba's SSA debug logging is on (that logs every statement it rewrites)."""

    def __init__(self, original):
        self._original = original

    def __call__(self, blocks):
        from numba.cuda.core import ssa

        if ssa._logger.isEnabledFor(logging.DEBUG):
            return self._original(blocks)
        return run_ssa(blocks)


def find_topo_order(self):
    """numba-cuda's CFGraph._find_topo_order without recursion: the same depth-first walk (successors in their
    order, back edges skipped, a node entered once) with an explicit stack, so the same reverse post-order, and no
    Python frame per block of the longest chain (the recursive walk needed the interpreter's recursion limit raised
    for kernels of > 1000 blocks in a chain)."""
    succs, back_edges = self._succs, self._back_edges
    entry = self._entry_point
    post_order, seen = [], {entry}
    stack = [(entry, iter(succs[entry]))]
    while stack:
        node, successors = stack[-1]
        for dest in successors:
            if dest not in seen and (node, dest) not in back_edges:
                seen.add(dest)
                stack.append((dest, iter(succs[dest])))
                break
        else:
            stack.pop()
            post_order.append(node)
    post_order.reverse()
    return post_order
