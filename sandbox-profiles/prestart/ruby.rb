# coderunner: a Ruby runtime started in a warm jail before its job exists.
#
# The worker starts this as the interpreter part of the language's `run` command plus this
# file (`ruby /.coderunner/prestart/ruby.rb`), so the VM and RubyGems are loaded while the
# jail waits. The jail is the job's own and serves one job only. On start the worker sends
# the frame the gate would have had (argv, environment, rlimits; see
# worker/isolation/gate.c — the worker has already applied the rlimits from outside), and
# this runs the entry file at the top level the way `ruby main.rb args...` would: $0,
# __FILE__ and ARGV as given, DATA after __END__, and Ruby's own report and exit status 1
# for an uncaught exception, with a backtrace that starts at the user's file.
#
# Before start, the only thing written is one ready marker on stderr, which the worker
# reads (and so removes) before the jail is offered to a job; the frame is read from stdin
# with exact-size sysreads, so not one byte of the program's own input is consumed. No top-level local
# variable is defined here: the program's top level is Ruby's own.
-> {
  read_exact = lambda do |n|
    buf = +""
    while buf.bytesize < n
      begin
        buf << STDIN.sysread(n - buf.bytesize)
      rescue EOFError
        exit!(0) # the worker closed the pipe: the job never started
      end
    end
    buf
  end
  u32 = -> { read_exact.(4).unpack1("V") }
  strings = -> { Array.new(u32.()) { read_exact.(u32.()).force_encoding(Encoding.default_external) } }

  STDERR.syswrite("\0coderunner-prestart-ready\n") # the worker waits for this before offering the jail
  exit!(0) unless read_exact.(4) == "CRG1"
  argv = strings.()
  env = strings.()
  read_exact.(24) # rlimits: already set on this process by the worker

  (ENV.delete("CODERUNNER_PRESTART_ENV") || "").split(",").each { |name| ENV.delete(name) }
  env.each do |item|
    name, value = item.split("=", 2)
    ENV[name] = value
  end

  entry = argv[1]
  ARGV.replace(argv[2..])
  $0 = entry
  source = File.binread(entry)
  code, data = source.split(/^__END__\r?\n/, 2)
  Object.const_set(:DATA, StringIO.new(data)) if data && (require "stringio")
  shim = __FILE__
  begin
    # __FILE__ as given, the real path for __dir__ and require_relative: as `ruby main.rb`.
    program = RubyVM::InstructionSequence.compile(code.force_encoding(Encoding::UTF_8), entry, File.realpath(entry), 1)
  rescue SyntaxError => e
    # The main script did not compile: Ruby reports just the compiler's message.
    $stderr.puts e.message
    exit 1
  end
  begin
    program.eval
  rescue Exception => e # rubocop:disable Lint/RescueException -- re-raised below
    if e.backtrace
      # Drop this shim's frames; the compiled top level is what Ruby calls <main>.
      e.set_backtrace(e.backtrace.reject { |line| line.start_with?(shim) }.map { |line| line.sub("in `<compiled>'", "in `<main>'") })
    end
    raise e
  end
}.call
