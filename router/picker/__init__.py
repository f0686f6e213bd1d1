"""The gateway's endpoint picker: Envoy's ext_proc service (docs/picker.md)."""
