// Kafka's Java client placing keyed records: for each key on stdin (one per line, its bytes in hex), `Utils.murmur2`
// of it, then for each partition count N given as an argument the partition the Java producer's default
// partitioner picks (`BuiltInPartitioner.partitionForKey`, i.e. `Utils.toPositive(Utils.murmur2(key)) % N`),
// tab-separated. A single-file program: java -cp 'kafka-clients.jar:slf4j-api.jar' Murmur.java 4 7
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.util.HexFormat;

import org.apache.kafka.clients.producer.internals.BuiltInPartitioner;
import org.apache.kafka.common.utils.Utils;

public class Murmur {
    public static void main(String[] args) throws Exception {
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        String line;
        while ((line = in.readLine()) != null) {
            byte[] key = HexFormat.of().parseHex(line.trim());
            StringBuilder out = new StringBuilder(Integer.toString(Utils.murmur2(key)));
            for (String n : args) {
                out.append('\t').append(BuiltInPartitioner.partitionForKey(key, Integer.parseInt(n)));
            }
            System.out.println(out);
        }
    }
}
