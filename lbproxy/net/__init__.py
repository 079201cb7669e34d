"""Moving bytes on trio: deadlines, the pump and its reactor."""
