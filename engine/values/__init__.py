"""Values every layer passes around: pure, frozen, no I/O.

What is where
- `scopes`: who a piece of durable state belongs to (`PlayScope` ⊂ `RunScope` ⊂ `MapScope`,
  `RunRef`), and `check_scope`, called by every engine operation before any query.
- `keys`: receipt keys, injective and prefix-safe byte strings.
- `codecs`: the wire codecs every action states its input and output with.
Canonical JSON is a value module of the same kind; it stays `engine.canonical`, a public
module path (docs/guide/python-api.md). Who may call: anything in runplane. These modules
import only
`engine.errors`, `engine.canonical` and `engine.limits.inputs`. Import the modules (the scope
types are also `engine`'s public names); this file re-exports nothing.
"""
