// coderunner: a Java VM started in a warm jail before its job exists.
//
// The worker compiles this once at start-up with the language's compile step and starts it
// the way the `run` command starts a job's class (`java <options> -cp . CoderunnerPrestart`,
// its class file put in the workspace for the start-up and removed before the job's files
// go in), so the VM is up and its classes loaded while the jail waits. (The JDK's
// source-file mode would save that compile, but it runs javac inside the VM at every
// warm-up: 1.2 s of CPU, against 0.1 s for the VM itself.) The jail is the job's
// own and serves one job only. On start the worker sends the frame the gate would have had
// (argv, environment, rlimits; see worker/isolation/gate.c: the worker has already applied
// the rlimits from outside, and a job's environment is the one this VM started with), and
// this runs the job's main class from the class path the way `java ... Main args` would:
// the same class loader, the `main` thread, the launcher's messages for a missing class or
// main method, and the VM's own report and exit status 1 for an uncaught exception, with a
// stack trace that ends at the user's main.
//
// Before start, the only thing written is one ready marker on stderr, which the worker reads
// (and so removes) before the jail is offered to a job; the frame is read from descriptor 0
// with exact-size reads, past System.in's buffer, so not one byte of the program's own input
// is consumed.

import java.io.FileDescriptor;
import java.io.FileInputStream;
import java.io.IOException;
import java.lang.reflect.InvocationTargetException;
import java.lang.reflect.Method;
import java.lang.reflect.Modifier;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.IdentityHashMap;
import java.util.List;
import java.util.Map;

public class CoderunnerPrestart {
    private static final FileInputStream FRAME = new FileInputStream(FileDescriptor.in);

    private static byte[] readExact(int n) throws IOException {
        byte[] buf = new byte[n];
        int got = 0;
        while (got < n) {
            int r = FRAME.read(buf, got, n - got);
            if (r < 0) {
                Runtime.getRuntime().halt(0); // the worker closed the pipe: the job never started
            }
            got += r;
        }
        return buf;
    }

    private static int u32() throws IOException {
        byte[] b = readExact(4);
        return (b[0] & 0xff) | (b[1] & 0xff) << 8 | (b[2] & 0xff) << 16 | (b[3] & 0xff) << 24;
    }

    private static List<String> strings() throws IOException {
        int n = u32();
        List<String> out = new ArrayList<>(n);
        for (int i = 0; i < n; i++) {
            out.add(new String(readExact(u32()), StandardCharsets.UTF_8));
        }
        return out;
    }

    public static void main(String[] ignored) throws Throwable {
        System.err.print("\0coderunner-prestart-ready\n");
        System.err.flush();
        if (!new String(readExact(4), StandardCharsets.ISO_8859_1).equals("CRG1")) {
            Runtime.getRuntime().halt(0);
        }
        List<String> argv = strings();
        strings(); // environment: the job's is the one this VM started with
        readExact(24); // rlimits: already set on this process by the worker

        // The launcher's own reading of the command: options (and the class path's value),
        // then the main class, then its arguments.
        int at = 1;
        while (at < argv.size() && argv.get(at).startsWith("-")) {
            String option = argv.get(at++);
            if (option.equals("-cp") || option.equals("-classpath") || option.equals("--class-path")) {
                at++;
            }
        }
        String name = argv.get(at);
        String[] args = argv.subList(at + 1, argv.size()).toArray(new String[0]);

        Class<?> main;
        try {
            main = Class.forName(name, false, ClassLoader.getSystemClassLoader());
        } catch (ClassNotFoundException | LinkageError e) {
            System.err.println("Error: Could not find or load main class " + name);
            System.err.println("Caused by: " + e);
            System.exit(1);
            return;
        }
        // The launcher's own checks of main, in its order and words (LauncherHelper.validateMainClass).
        Method method;
        try {
            method = main.getMethod("main", String[].class);
        } catch (NoSuchMethodException e) {
            System.err.println("Error: Main method not found in class " + name + ", please define the main method as:");
            System.err.println("   public static void main(String[] args)");
            System.err.println("or a JavaFX application class must extend javafx.application.Application");
            System.exit(1);
            return;
        } catch (LinkageError e) {
            System.err.println("Error: Unable to initialize main class " + name);
            System.err.println("Caused by: " + e.getClass().getName() + ": " + e.getLocalizedMessage());
            System.exit(1);
            return;
        }
        String declaring = method.getDeclaringClass().getName();
        if (!Modifier.isStatic(method.getModifiers())) {
            System.err.println("Error: Main method is not static in class " + declaring + ", please define the main method as:");
            System.err.println("   public static void main(String[] args)");
            System.exit(1);
            return;
        }
        if (method.getReturnType() != void.class) {
            System.err.println("Error: Main method must return a value of type void in class " + declaring + ", please ");
            System.err.println("define the main method as:");
            System.err.println("   public static void main(String[] args)");
            System.exit(1);
            return;
        }
        try {
            method.invoke(null, (Object) args);
        } catch (InvocationTargetException e) {
            throw withoutThisCall(e.getCause(), new IdentityHashMap<>());
        } catch (Throwable e) {
            // Thrown by the call itself: the main class's static initializer failed
            // (ExceptionInInitializerError), which the launcher's JNI call of main gets with no
            // Java frame below it.
            throw withoutThisCall(e, new IdentityHashMap<>());
        }
    }

    // Drops the frames of this call (this method at the bottom and the reflection above it)
    // from `t`, its causes and its suppressed exceptions: the launcher calls main from native
    // code, so a plain run's traces end at the user's main (or <clinit>), and a cause's
    // "... n more" counts the frames it shares with the trace that encloses it.
    private static Throwable withoutThisCall(Throwable t, Map<Throwable, Boolean> seen) {
        if (t == null || seen.put(t, Boolean.TRUE) != null) {
            return t;
        }
        StackTraceElement[] trace = t.getStackTrace();
        int end = trace.length;
        if (end > 0 && trace[end - 1].getClassName().equals(CoderunnerPrestart.class.getName()) && trace[end - 1].getMethodName().equals("main")) {
            end--;
            while (end > 0 && isReflection(trace[end - 1])) {
                end--;
            }
            t.setStackTrace(Arrays.copyOf(trace, end));
        }
        withoutThisCall(t.getCause(), seen);
        for (Throwable suppressed : t.getSuppressed()) {
            withoutThisCall(suppressed, seen);
        }
        return t;
    }

    private static boolean isReflection(StackTraceElement frame) {
        String c = frame.getClassName();
        return c.startsWith("jdk.internal.reflect.") || c.equals("java.lang.reflect.Method");
    }
}
