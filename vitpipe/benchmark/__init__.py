"""vitpipe's benchmark: one module per comparison (``--only`` name = module name), the settings and their
check (``config``), the timing/memory/FLOP toolbox (``common``), the training recipe it times
(``recipe``), the table (``table``), the CLI body (``run``), the MAE paper's reference forward
(``reference_mae``) and the GPU check (``gpu_check``). Nothing is imported here, so importing one
part does not pull in every comparison's dependencies."""
