"""Shipped tuning tables: `kgen tune` results for named GPUs (one JSON file each), read by
`kgen.runtime.tuning_table` under the user's own table. Regenerate one on its GPU with
`kgen tune SPEC --out kgen/tuning/<gpu>.json` for each shipped spec."""
