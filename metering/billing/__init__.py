"""Finance: prices per model, usage reports and statements, exports, spend alerts."""
