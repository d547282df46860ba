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
  strings.() # environment: the job's is the one this process started with (Prime.adopts)
  read_exact.(24) # rlimits: already set on this process by the worker

  entry = argv[1]
  ARGV.replace(argv[2..])
  $0 = entry
  # The name the process was started by, which was this shim's; `ruby main.rb` gives the entry.
  Process.singleton_class.define_method(:argv0, &entry.dup.method(:itself))
  shim = __FILE__
  begin
    # Compiled from the file as `ruby main.rb` compiles it: its magic comments, __FILE__ as
    # given, the real path for __dir__ and require_relative, the top level labelled <main>
    # (and its blocks "block in <main>"), and nothing past the __END__ line the parser stops at.
    program = RubyVM::InstructionSequence.compile_file(entry)
  rescue SyntaxError => e
    # The main script did not compile: Ruby reports just the compiler's message.
    $stderr.puts e.message
    exit 1
  end
  source = File.binread(entry)
  if source.match?(/^__END__(?:\r?\n|\z)/)
    # DATA as `ruby main.rb` leaves it: the script's own File, open just past the __END__ line
    # the parser stopped at. Only Ruby's lexer knows which line that is (one in a heredoc or a
    # =begin block is text), so Ripper finds it; a program without such a line never loads it.
    require "ripper"
    lexer = Ripper::Lexer.new(source.dup.force_encoding(Encoding::UTF_8))
    (line, column), _, token = lexer.lex.find { |_, kind| kind == :on___end__ }
    if token
      data = File.open(entry, external_encoding: lexer.encoding) # the source's, as Ruby reads DATA
      data.seek(source.lines[0, line - 1].sum(&:bytesize) + column + token.bytesize)
      Object.const_set(:DATA, data)
    end
  end
  begin
    program.eval
  rescue Exception => e # rubocop:disable Lint/RescueException -- re-raised below
    # Drop this shim's frames (its eval and this lambda) from the error and from its causes,
    # whose backtraces Ruby prints too.
    seen = {}.compare_by_identity
    error = e
    until error.nil? || seen[error]
      seen[error] = true
      error.set_backtrace(error.backtrace.reject { |frame| frame.start_with?(shim) }) if error.backtrace && !error.frozen?
      error = error.cause
    end
    raise e
  end
}.call
