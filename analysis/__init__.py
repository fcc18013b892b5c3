"""Reading run directories back: status, tables, reports."""
